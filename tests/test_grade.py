"""Self-study: ``minivllm grade NB.ipynb [...]`` (python -m minivllm.learn.exercises grade) runs
each notebook top to bottom with nbgrader's validator and prints pass or FAIL per exercise with the
check's hint. Two notebooks with the same file name are two reports named by their paths; a correct
answer in a new cell passes in the notebook and in the command alike, with a warning that the
exercise is defined twice; a wrong answer shows its hint, an endless loop runs into the time limit
and the rest of the notebook is still checked."""
import copy
import os

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbgrader")
pytest.importorskip("ipykernel")

from minivllm.learn.exercises import course  # noqa: E402
from minivllm.learn.exercises.__main__ import main  # noqa: E402

NB = os.path.join(course.NOTEBOOKS_DIR, "04_exercises.ipynb")
SOLUTIONS = course.solutions("spec_decode")

NOT_NORMALISED = ("def residual_distribution(p_target, p_draft):\n"
                  "    return (p_target - p_draft).clamp_min(0)\n")
LOOP = ("def num_blocks_to_allocate(num_computed_tokens, num_new_tokens, num_lookahead_tokens,\n"
        "                           num_held_blocks, block_size, max_model_len):\n"
        "    while True:\n"
        "        pass\n")


def _write(path, nb):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    nbformat.write(nb, path)
    return path


def _bob(released):
    """Bob's 04: a wrong residual, the n-gram stub left with a correct answer in a new cell below
    it, an endless loop, one stub untouched, the rest solved."""
    nb = course.fill(copy.deepcopy(released), {
        "residual_distribution": NOT_NORMALISED, "num_blocks_to_allocate": LOOP,
        **{k: v for k, v in SOLUTIONS.items()
           if k not in ("residual_distribution", "propose_last_match", "num_blocks_to_allocate",
                        "spec_decode_logits_indices")}})
    stub = next(i for i, c in enumerate(nb.cells) if course.grade_id(c) == "propose_last_match")
    nb.cells.insert(stub + 1, nbformat.v4.new_code_cell(SOLUTIONS["propose_last_match"]))
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """``grade alice/04_exercises.ipynb bob/04_exercises.ipynb --timeout 10`` run once: (its exit
    status, what it printed, the reports it made, the two paths)."""
    import contextlib
    import io
    from minivllm.learn.exercises import grade
    root = tmp_path_factory.mktemp("self_study")
    released = nbformat.read(NB, as_version=4)
    alice = _write(str(root / "alice" / "04_exercises.ipynb"),
                   course.fill(copy.deepcopy(released), SOLUTIONS))
    bob = _write(str(root / "bob" / "04_exercises.ipynb"), _bob(released))
    reports, check = [], grade.check_notebook

    def recorded(*args, **kwargs):
        reports.append(check(*args, **kwargs))
        return reports[-1]

    out = io.StringIO()
    grade.check_notebook = recorded
    try:
        with contextlib.redirect_stdout(out):
            status = main(["grade", alice, bob, "--timeout", "10"])
    finally:
        grade.check_notebook = check
    return status, out.getvalue(), reports, (alice, bob)


def test_two_notebooks_of_one_name_are_two_reports_named_by_path(graded):
    status, out, _, (alice, bob) = graded
    assert status == 1
    a, b = out.split(bob + "\n")
    assert a.startswith(alice + "\n")
    names = list(SOLUTIONS)
    assert all(f"  pass  {n}" in a for n in names), a
    assert f"{len(names)} of {len(names)} exercises pass" in a
    assert "  FAIL  residual_distribution" in b and "is wrong for case" in b
    assert "divide by their sum" in b                         # the check's hint
    assert "  pass  propose_last_match" in b
    assert "propose_last_match is defined in cells" in b      # the stub's cell and the new one
    assert "  FAIL  num_blocks_to_allocate\n        ran past the 10 s time limit" in b   # the loop
    assert "  FAIL  spec_decode_logits_indices" in b and "not written yet" in b
    assert "  pass  walk_suffix_tree" in b                    # checked after the loop


def test_a_correct_answer_in_a_new_cell_passes_in_the_notebook_and_the_command(graded):
    """The verdict comes from the notebook's own run: the ✓ the student saw is the pass."""
    report = graded[2][1]
    verdicts = {v.exercise: v.passed for v in report.verdicts}
    assert verdicts["propose_last_match"] and not verdicts["residual_distribution"]
    seen = [c for c in report.executed.cells
            if course.grade_id(c) == "propose_last_match_test"][0]
    assert "\u2713 propose_last_match" in "".join(o.get("text", "") for o in seen.outputs)


def test_grade_without_nbgrader_says_which_extra_to_install(monkeypatch, capsys):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "nbgrader" else find_spec(name, *a))
    with pytest.raises(SystemExit) as e:
        main(["grade", NB])
    assert e.value.code == 2
    assert 'pip install "minivllm[classroom]"' in capsys.readouterr().err


def test_a_missing_notebook_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["grade", str(tmp_path / "missing.ipynb")])
    assert e.value.code == 2 and "no such notebook" in capsys.readouterr().err
