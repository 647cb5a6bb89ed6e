"""Case g, vLLM side: vLLM's own benchmark client against minivllm's server and against vLLM's.

IN: {"minivllm_url", "model", "served_model_name", "num_prompts", "input_len", "output_len",
"timeout"}. Runs ``vllm bench serve --backend openai --dataset-name random`` (vLLM's CLI through
g_vllm_cli.py) against the minivllm server the test started, then starts ``vllm serve`` on a
free port (its own process group, stopped by its id), runs the same client against it, and writes
both result JSONs (the client's ``--save-result`` files) as {"minivllm": ..., "vllm": ...}.
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

CLI = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "g_vllm_cli.py")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(url: str, p: dict, out_dir: str, name: str) -> dict:
    cmd = [*CLI, "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", p["served_model_name"],
           "--tokenizer", p["model"], "--dataset-name", "random",
           "--random-input-len", str(p["input_len"]), "--random-output-len", str(p["output_len"]),
           "--num-prompts", str(p["num_prompts"]), "--ignore-eos", "--temperature", "0",
           "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", out_dir,
           "--result-filename", f"{name}.json", "--ready-check-timeout-sec", "60"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=p["timeout"])
    if run.returncode != 0:
        raise SystemExit(f"vllm bench serve against {name} failed ({run.returncode}):\n"
                         f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    with open(os.path.join(out_dir, f"{name}.json")) as f:
        result = json.load(f)
    result["client_stdout_tail"] = run.stdout[-1500:]
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
    result = {"minivllm": bench(p["minivllm_url"], p, out_dir, "minivllm")}
    port = free_port()
    log = os.path.join(out_dir, "vllm_serve.log")
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            [*CLI, "serve", p["model"], "--host", "127.0.0.1", "--port",
             str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
             "--served-model-name", p["served_model_name"], "--seed", "0"],
            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
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
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
