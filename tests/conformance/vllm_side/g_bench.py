"""Case g, vLLM side: vLLM's own benchmark client against ``vllm serve`` and minivllm's server.

IN: {"minivllm_url", "model", "served_model_name", "num_prompts", "input_len", "output_len",
"timeout"}. Starts ``vllm serve`` on a free port (its own process group, stopped by its id) and,
while it boots, imports vLLM's benchmark; runs ``vllm bench serve --backend openai
--dataset-name random`` against it, then against the minivllm server the test started (which may
still be starting: the client's ready check waits for it). Writes both result JSONs (the client's
``--save-result`` files) as {"minivllm": ..., "vllm": ...}.

The client is vLLM's: the arguments go through the CLI's own parser (``add_cli_args``) to the
function the ``vllm bench serve`` subcommand calls (vllm/entrypoints/cli/benchmark/serve.py,
``main``), in this one process: the CLI as a command would import vLLM once per run (~10 s).
Only one server is measured at a time; the other sits idle.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

# The version shim, before vLLM is imported: vllm/platforms reads the version to pick the CPU.
import g_vllm_cli  # noqa: F401

CLI = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "g_vllm_cli.py")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(url: str, p: dict, out_dir: str, name: str) -> dict:
    """``vllm bench serve`` against ``url``; its saved result JSON."""
    import contextlib
    import io

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    argv = ["--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", p["served_model_name"],
           "--tokenizer", p["model"], "--dataset-name", "random",
           "--random-input-len", str(p["input_len"]), "--random-output-len", str(p["output_len"]),
           "--num-prompts", str(p["num_prompts"]), "--ignore-eos", "--temperature", "0",
           "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", out_dir,
           "--result-filename", f"{name}.json", "--ready-check-timeout-sec", "240"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            bench_main(parser.parse_args(argv))
    except BaseException as e:
        raise SystemExit(f"vllm bench serve against {name} failed ({e!r}):\n"
                         f"{stdout.getvalue()[-3000:]}") from e
    with open(os.path.join(out_dir, f"{name}.json")) as f:
        result = json.load(f)
    result["client_stdout_tail"] = stdout.getvalue()[-1500:]
    return result


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited ({proc.returncode}):\n{open(log).read()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"vllm serve not healthy after {timeout} s:\n{open(log).read()[-3000:]}")


def main() -> None:
    with open(sys.argv[1]) as f:
        p = json.load(f)
    out_dir = tempfile.mkdtemp(prefix="g_bench_")
    port = free_port()
    log = os.path.join(out_dir, "vllm_serve.log")
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            [*CLI, "serve", p["model"], "--host", "127.0.0.1", "--port",
             str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
             "--served-model-name", p["served_model_name"], "--seed", "0"],
            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    result = {}
    try:
        t0 = time.monotonic()
        import vllm.benchmarks.serve  # noqa: F401  (the client's import, while the server boots)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 240, log)
        result["vllm_serve_start_s"] = round(time.monotonic() - t0, 1)
        result["vllm"] = bench(url, p, out_dir, "vllm")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    result["minivllm"] = bench(p["minivllm_url"], p, out_dir, "minivllm")
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
