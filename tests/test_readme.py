"""README: under 350 lines, every code block parses (python, bash, json), every module it runs
exists, its breakpoint table matches minivllm.steps, and its Python blocks run as written (default
model). Also bench/results.py, which writes the tables README links to."""
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from minivllm import steps
from minivllm.bench import results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(REPO, "README.md")).read()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.S | re.M)


def test_readme_is_short_and_every_block_parses(tmp_path):
    assert len(README.splitlines()) < 350
    assert {lang for lang, _ in BLOCKS} <= {"bash", "python", "json", "text"}   # text: the tree
    for lang, code in BLOCKS:
        if lang == "python":
            ast.parse(code)
        elif lang == "json":
            json.loads(code)
        elif lang == "bash":
            script = tmp_path / "block.sh"
            script.write_text(code)
            proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
            assert proc.returncode == 0, (code, proc.stderr)
    modules = set(re.findall(r"python -m ([\w.]+)", README)) | {
        c["module"] for lang, code in BLOCKS if lang == "json" for c in json.loads(code)["configurations"]}
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module
    from minivllm.cli import COMMANDS
    commands = set(re.findall(r"`minivllm (\w+)", README)) | {
        c for lang, code in BLOCKS if lang == "bash" for c in re.findall(r"^minivllm (\w+)", code, re.M)}
    for command in commands:
        assert command in COMMANDS, f"README runs `minivllm {command}`, which is no subcommand"


def test_readme_breakpoint_table_matches_the_registry():
    rows = re.findall(r"^\| `([\w.]+)` \| [^|]+ \| `([\w.]+)` \|(?: [^|]+ \|)?$", README, re.M)
    assert [i for i, _ in rows] == list(steps.REGISTRY)
    assert all(steps.REGISTRY[i].function == f for i, f in rows)
    # The first two commands stay as they were.
    assert BLOCKS[0][1].startswith("python -m venv .venv && . .venv/bin/activate && pip install torch")
    assert BLOCKS[1][1].strip() == ".venv/bin/python tests/suite.py"


def test_readme_python_blocks_run(smollm2_dir):
    code = "\n".join(f"exec(compile({c!r}, 'README block {i}', 'exec'), {{}})"
                     for i, (lang, c) in enumerate(BLOCKS) if lang == "python")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"^(\d+) of (\d+) prompt tokens loaded", proc.stdout, re.M)
    assert m and int(m.group(1)) > 0, proc.stdout[-2000:]


def test_results_sections_are_replaced_alone(tmp_path):
    path = str(tmp_path / "RESULTS.md")
    results.write_section("pd", "old", path)
    results.write_section("spec", "| a |\n|---|\n| 1 |", path)
    results.write_section("pd", "new table", path)
    text = open(path).read()
    assert "old" not in text and "new table" in text and "| 1 |" in text
    assert text.count("<!-- bench:pd -->") == 1
    with pytest.raises(ValueError, match="section name"):
        results.write_section("Bad Name", "x", path)

    def fake_bench(argv):
        print("[1/2] running ...")
        print("prompt tokens | ratio\n--------------|------\n          256 | 0.17x")
        print("note: one run")
    results.capture_markdown("pd", ["--lengths", "256", "--markdown=pd-small"], fake_bench, path)
    text = open(path).read()
    assert "`python -m minivllm.bench pd --lengths 256`" in text
    assert "| prompt tokens | ratio |\n| --- | --- |\n| 256 | 0.17x |" in text
    assert "```\nnote: one run\n```" in text and "[1/2]" not in text
    assert "new table" in text                      # the other sections are untouched


LAYOUT_ENTRY = re.compile(r"`([\w/]+\.py)` (\d+)")


def layout_rows() -> list[tuple[str, int]]:
    """The README's reading order: ``(path under minivllm/, line count)`` per core file."""
    section = README[README.index("## Layout"):]
    return [(path, int(n)) for path, n in LAYOUT_ENTRY.findall(section)]


def test_readme_layout_lists_current_files_and_line_counts():
    rows = layout_rows()
    assert len(rows) >= 20, rows
    stale = []
    for path, n in rows:
        full = os.path.join(REPO, "minivllm", path)
        assert os.path.isfile(full), f"README Layout lists {path}, which does not exist"
        with open(full) as fh:
            actual = sum(1 for _ in fh)
        if actual != n:
            stale.append(f"`{path}` {n} -> {actual}")
    assert not stale, "README Layout: update the line counts: " + ", ".join(stale)
