"""The article's speculative-decoding script runs as written (import changed, default model)."""
import subprocess
import sys


def test_speculative_decoding_example_runs(smollm2_dir):
    proc = subprocess.run([sys.executable, "-m", "minivllm.examples.speculative_decoding"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("Prompt: ")]
    assert len(lines) == 2 and "Hello, my name is" in lines[0]
    assert all("Generated text: " in ln for ln in lines)
