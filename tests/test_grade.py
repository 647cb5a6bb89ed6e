"""python -m minivllm.exercises grade: the solutions pass, the templates fail cleanly with their
reason, and a wrong answer, an infinite loop, a flood of output and a cell that raises each fail
only their own exercise, within the time limit."""
import csv
import importlib.util
import inspect
import os
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

from minivllm.learn.exercises.__main__ import main  # noqa: E402

NB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
SPEC = ["residual_distribution", "propose_last_match", "num_blocks_to_allocate",
        "spec_decode_logits_indices", "walk_suffix_tree"]
PD = ["decode_load_plan", "MyKVConnector"]


def _solutions(number: str):
    name = {"04": "04_exercises_solutions.py", "07": "07_pd_exercises_solutions.py"}[number]
    spec = importlib.util.spec_from_file_location(f"solutions{number}", os.path.join(NB_DIR, "solutions", name))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # inspect.getsource needs it for classes
    spec.loader.exec_module(mod)
    return mod


def _notebook(tmp_path, src: str, out: str, replace=None, solved=True):
    """A copy of notebooks/SRC with its exercise cells filled from the solutions (or ``replace``)."""
    nb = nbformat.read(os.path.join(NB_DIR, src), as_version=4)
    sols = _solutions(src[:2])
    for cell in nb.cells:
        if "exercise" in cell.metadata.get("tags", []):
            name = cell.source.split("def " if "def " in cell.source.split("\n")[0] else "class ", 1)[1]
            name = name.split("(", 1)[0]
            if replace and name in replace:
                cell.source = replace[name]
            elif solved:
                cell.source = "import torch\n\n" + inspect.getsource(getattr(sols, name))
    path = tmp_path / out
    nbformat.write(nb, str(path))
    return str(path)


def _grade(args, capsys):
    rc = main(["grade", *args])
    return rc, capsys.readouterr().out


def _csv(path):
    rows = list(csv.reader(open(path)))
    return {r[0]: dict(zip(rows[0][1:], r[1:])) for r in rows[1:]}


def test_solutions_all_pass(tmp_path, capsys):
    nbs = [_notebook(tmp_path, "04_exercises.ipynb", "alice.ipynb"),
           _notebook(tmp_path, "07_pd_exercises.ipynb", "alice_pd.ipynb")]
    rc, out = _grade([*nbs, "--csv", str(tmp_path / "g.csv")], capsys)
    assert rc == 0, out
    table = _csv(tmp_path / "g.csv")
    assert set(table["alice.ipynb"][n] for n in SPEC) == {"pass"}
    assert set(table["alice_pd.ipynb"][n] for n in PD) == {"pass"}
    assert "Failures" not in out


def test_templates_all_fail_with_their_reason(tmp_path, capsys):
    nbs = [os.path.join(NB_DIR, "04_exercises.ipynb"), os.path.join(NB_DIR, "07_pd_exercises.ipynb")]
    rc, out = _grade([*nbs, "--csv", str(tmp_path / "g.csv")], capsys)
    assert rc == 1
    table = _csv(tmp_path / "g.csv")
    for nb, names in (("04_exercises.ipynb", SPEC), ("07_pd_exercises.ipynb", PD)):
        for name in names:
            assert table[nb][name].startswith("FAIL:") and f"{name} is not written yet" in table[nb][name]


LOOP = "def propose_last_match(context, min_n, max_n, k):\n    while True:\n        pass\n"
WRONG = ("def residual_distribution(p_target, p_draft):\n"
         "    r = p_target - p_draft\n    return r / r.sum()\n")
LOUD = ("def decode_load_plan(block_size, num_prompt_tokens, num_local_hit_tokens):\n"
        "    for _ in range(10 ** 7):\n        print('x' * 100)\n")
RAISES = "class MyKVConnector:\n    pass\n\nraise RuntimeError('half-finished cell')\n"


def test_wrong_loop_loud_and_raising_fail_alone(tmp_path, capsys):
    bad = _notebook(tmp_path, "04_exercises.ipynb", "bob.ipynb",
                    replace={"propose_last_match": LOOP, "residual_distribution": WRONG})
    noisy = _notebook(tmp_path, "07_pd_exercises.ipynb", "carol.ipynb",
                      replace={"decode_load_plan": LOUD, "MyKVConnector": RAISES})
    t0 = time.monotonic()
    rc, out = _grade([bad, noisy, "--timeout", "10", "--csv", str(tmp_path / "g.csv")], capsys)
    elapsed = time.monotonic() - t0
    assert rc == 1
    bob, carol = (_csv(tmp_path / "g.csv")[n] for n in ("bob.ipynb", "carol.ipynb"))
    assert "is wrong for case" in bob["residual_distribution"] and "clamp" in bob["residual_distribution"]
    assert "ran past the 10 s time limit" in bob["propose_last_match"]
    assert bob["num_blocks_to_allocate"] == bob["spec_decode_logits_indices"] == "pass"
    assert "printed more than 100000 bytes" in carol["decode_load_plan"]
    assert "raised RuntimeError: half-finished cell" in carol["MyKVConnector"]
    assert elapsed < 150, elapsed


def test_only_grades_one_exercise_and_leaves_the_others_not_attempted(tmp_path, capsys):
    """``--only 1`` on a notebook where only exercise 1 is written: it passes, the four others are
    "not attempted" (not FAIL), the exit status is 0; an --only that names nothing is an error."""
    sol = _solutions("04")
    nb = _notebook(tmp_path, "04_exercises.ipynb", "bob.ipynb", solved=False, replace={
        "residual_distribution": "import torch\n\n" + inspect.getsource(sol.residual_distribution)})
    rc, out = _grade([nb, "--only", "1", "--csv", str(tmp_path / "g.csv")], capsys)
    assert rc == 0, out
    row = _csv(tmp_path / "g.csv")["bob.ipynb"]
    assert row["residual_distribution"] == "pass"
    assert [row[n] for n in SPEC[1:]] == ["not attempted"] * 4, row
    assert "Failures" not in out
    with pytest.raises(SystemExit):
        main(["grade", nb, "--only", "9"])
