"""The ``minivllm`` console script, as vLLM's ``vllm`` (vllm/entrypoints/cli/main.py): one command
whose subcommands are the package's entry points. ``minivllm serve [MODEL] ...`` starts the
OpenAI-compatible server with vLLM's flag names; ``minivllm tour spec`` stops at each article step;
``minivllm COMMAND --help`` says what each takes. Every subcommand is also its module's
``python -m`` command (the second column), which keeps working as it is."""
from __future__ import annotations

import importlib
import sys
from typing import NamedTuple, Optional


class Command(NamedTuple):
    module: str      # its ``main(argv)`` runs the command
    python_m: str    # the same command as ``python -m ...``
    help: str
    prefix: tuple[str, ...] = ()   # words put before the arguments (a module with subcommands)


COMMANDS: dict[str, Command] = {
    "serve": Command("minivllm.entrypoints.openai.api_server", "minivllm.serve",
                     "the OpenAI-compatible server (vllm serve)"),
    "tour": Command("minivllm.learn.tour", "minivllm.tour",
                    "stop at each article step in the engine: tour spec | tour pd"),
    "grade": Command("minivllm.learn.exercises.__main__", "minivllm.learn.exercises",
                     "check exercise notebooks alone (nbgrader's validator): grade NB.ipynb [...]",
                     ("grade",)),
    "bench": Command("minivllm.bench.__main__", "minivllm.bench",
                     "side-by-side benchmarks: bench {throughput,spec,pd,gpu,...}"),
    "launch": Command("minivllm.disagg.launch", "minivllm.disagg.launch",
                      "N prefill + M decode servers and a proxy on this machine"),
    "fleet": Command("minivllm.disagg.fleet.driver", "minivllm.disagg.fleet",
                     "P/D on Ray Serve: KV-aware routing, both roles autoscaled"),
    "kvstore": Command("minivllm.distributed.kv_transfer.redis_server", "minivllm.kvstore",
                       "a Redis server as the KV-cache service"),
    "train": Command("minivllm.train.__main__", "minivllm.train",
                     "train a learned drafter: train {eagle,eagle3,medusa}"),
    "sim": Command("minivllm.sim.__main__", "minivllm.sim",
                   "the engine's scheduler in virtual time: sim {profile,run,fleet,plan}"),
    "notebooks": Command("minivllm.learn.notebooks", "minivllm.notebooks",
                         "run or check the stored notebooks"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = [f"  {name:<{width}}  {c.help}  (python -m {c.python_m})"
            for name, c in COMMANDS.items()]
    return ("usage: minivllm COMMAND [ARGS ...]   (minivllm COMMAND --help)\n\ncommands:\n"
            + "\n".join(rows))


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        sys.exit(0 if argv else 2)
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"minivllm: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    status = importlib.import_module(command.module).main([*command.prefix, *argv[1:]])
    sys.exit(status or 0)


if __name__ == "__main__":
    main()
