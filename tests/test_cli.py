"""The ``minivllm`` console script (minivllm/cli.py, as vLLM's ``vllm``): every subcommand answers
``--help`` through the installed script, and is the same command as its ``python -m`` name."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minivllm.cli import COMMANDS, main


def script() -> list[str]:
    """The installed console script beside this Python (``pip install -e .`` writes it)."""
    path = os.path.join(os.path.dirname(sys.executable), "minivllm")
    assert os.path.isfile(path), f"no console script at {path}: pip install -e . writes it"
    return [path]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_answers_help(name):
    proc = subprocess.run(script() + [name, "--help"], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.lstrip().startswith("usage:"), proc.stdout[:500]


def test_the_python_m_names_exist_and_the_script_lists_every_command(capsys):
    import importlib.util
    for name, command in COMMANDS.items():
        assert importlib.util.find_spec(command.module) is not None, name
        assert importlib.util.find_spec(command.python_m) is not None, name
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS)
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_grade_is_the_exercises_grade_command(tmp_path, capsys):
    """``minivllm grade NB`` is ``python -m minivllm.exercises grade NB``: a missing notebook is
    the same usage error."""
    with pytest.raises(SystemExit) as e:
        main(["grade", str(tmp_path / "missing.ipynb")])
    assert e.value.code == 2
    assert "no such notebook" in capsys.readouterr().err


def test_sim_is_the_simulators_command(tmp_path, capsys, monkeypatch):
    """``minivllm sim run`` is ``python -m minivllm.sim run``: with no cost model stored for the
    model on this machine it exits 2 and names the command that measures one."""
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 8, "output_tokens": 4}\n')
    with pytest.raises(SystemExit) as e:
        main(["sim", "run", "--trace", str(trace), "--model", "some/model"])
    assert e.value.code == 2
    assert "python -m minivllm.sim profile --model some/model" in capsys.readouterr().err
