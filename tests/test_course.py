"""The course end to end, with nbgrader's own command line, on a temporary copy of notebooks/course.

``nbgrader generate_assignment`` writes the student notebooks, which must be the committed ones
(notebooks/<nb>.ipynb). Then six students submit:
- ``ref``: the reference solutions (the source notebooks' solution cells), every assignment;
- ``mistake``: one common mistake per exercise (tests/course_answers_*.py), every assignment; this
  student also edits one locked test cell to ``pass`` and deletes another;
- ``loop``: an endless loop in one exercise of spec_decode (graded with 10 s time limits);
- ``raises``: a cell that raises in one exercise of spec_decode;
- ``cheat``: the stubs left, a cell that patches the checks (their registry, the check functions in
  sys.modules, the comparison helpers, the forbidden-call guard), one solution that calls the
  package's own implementation and one that patches a helper while its check runs;
- ``dead``: the reference solutions after a cell that kills the kernel (``os._exit``).
``nbgrader autograde`` (the course's configuration: a time limit per cell, deleted test cells
added back, the checks run again in a fresh process), ``export`` (the CSV) and
``generate_feedback``. Points per exercise come from nbgrader's gradebook API (``export`` writes
one total per student and assignment). Set MINIVLLM_FEEDBACK_SCREENSHOT=1 to write
figures/course_feedback.png, a feedback page as the mistake student sees it.
"""
from __future__ import annotations

import ast
import copy
import csv
import glob
import html
import importlib.util
import json
import os
import re
import time

import pytest

if importlib.util.find_spec("nbgrader") is None:
    if os.environ.get("CI"):
        pytest.fail("CI installs nbgrader (pip install -e '.[classroom]')", pytrace=False)
    pytest.skip("needs nbgrader: pip install -e '.[classroom]'", allow_module_level=True)

import nbformat  # noqa: E402

from minivllm.learn.exercises import course  # noqa: E402
from minivllm.learn.exercises.isolate import is_test_cell, checks_of  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
SPEC = "spec_decode"
LOOP_EXERCISE = "num_blocks_to_allocate"           # spec_decode's third exercise: more follow
RAISES_EXERCISE = "spec_decode_logits_indices"
OWN_IMPLEMENTATION = ("propose_last_match", (
    "def propose_last_match(context, min_n, max_n, k):\n"
    "    from minivllm.spec_decode.ngram_proposer import NgramProposer\n"
    "    return NgramProposer(min_n, max_n, k, match=\"last\").propose(context)\n"))
PATCH_WHILE_CHECKED = ("walk_suffix_tree", (
    "def walk_suffix_tree(node, max_tokens, min_token_prob):\n"
    "    import minivllm.learn.exercises.spec as spec\n"
    "    spec._fail = lambda *args, **kwargs: None       # every comparison passes from now on\n"
    "    return [], []\n"))
# The cell the issue names: it runs in the student's kernel before the test cells.
PATCH_CELL = """import sys
from contextlib import nullcontext
import minivllm.learn.exercises.registry as registry
exercises.CHECKS.update({k: (lambda f: True) for k in exercises.CHECKS})
for name in [n for n in dir(exercises) if n.startswith("check_")]:
    for module in list(sys.modules.values()):
        if getattr(module, name, None) is not None:
            setattr(module, name, lambda fn, cases="all": None)
for module in [m for n, m in list(sys.modules.items()) if n.startswith("minivllm.learn")]:
    for helper in ("_fail", "_call"):
        if hasattr(module, helper):
            setattr(module, helper, lambda *args, **kwargs: None)
registry.no_forbidden_calls = lambda *args, **kwargs: nullcontext()
registry.EXERCISES.clear()
"""
LOOP = "    while True:\n        pass\n"
DEAD_KERNEL = "import os\nos._exit(1)\n"
STUDENTS = ("ref", "mistake", "loop", "raises", "cheat", "dead")
RAISE = "raise RuntimeError(\"half-finished cell\")\n"


def _answers() -> dict:
    """ANSWERS of every tests/course_answers_*.py: {exercise: {"mistake", "hint"}}."""
    found = {}
    for path in sorted(glob.glob(os.path.join(TESTS, "course_answers_*.py"))):
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found.update(module.ANSWERS)
    return found


def _exercises(nb) -> dict[str, str]:
    """{exercise (the name its test cell checks): the test cell's grade_id} of a notebook."""
    found = {}
    for cell in nb.cells:
        if is_test_cell(cell):
            for op in checks_of(cell.source):
                if "check" in op:
                    found[op["arg"]] = course.grade_id(cell)
    return found


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def _submit(root: str, student: str, assignment: str, name: str, nb) -> None:
    folder = os.path.join(root, "submitted", student, assignment)
    os.makedirs(folder, exist_ok=True)
    nbformat.write(nb, os.path.join(folder, name))


def _with_loop(source: str) -> str:
    """The solution with its body replaced by an endless loop (signature and docstring kept)."""
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
    first = fn.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    keep = first.end_lineno if docstring else first.lineno - 1
    return "\n".join(source.split("\n")[:keep]) + "\n" + LOOP


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    """The whole cycle once: (course folder, {(student, assignment, notebook): {exercise:
    (score, max)}}, exercises per assignment, the CSV rows, (seconds, seconds per nbgrader
    step))."""
    t0 = time.monotonic()
    steps = {}

    def nbgrader(args, check=True):
        start = time.monotonic()
        done = course.nbgrader(args, root, check=check)
        steps[" ".join(args[:2] + args[3:4])] = time.monotonic() - start
        return done
    root = course.copy_course(course.COURSE_DIR, str(tmp_path_factory.mktemp("course")))
    nbgrader(["generate_assignment", "*", "--force"])
    released = {a: {os.path.basename(p): nbformat.read(
        os.path.join(root, "release", a, os.path.basename(p)), as_version=4) for p in paths}
        for a, paths in course.source_notebooks().items()}
    answers = _answers()
    for assignment, notebooks in released.items():
        solutions = course.solutions(assignment)
        for name, nb in notebooks.items():
            names = _exercises(nb)
            _submit(root, "ref", assignment, name, course.fill(copy.deepcopy(nb), solutions))
            mistaken = course.fill(copy.deepcopy(nb), {
                **solutions, **{k: answers[k]["mistake"] for k in names if k in answers}})
            if assignment == SPEC:       # edit one locked test cell, delete another
                edited, deleted = [g for k, g in names.items() if k in answers][:2]
                for cell in mistaken.cells:
                    if course.grade_id(cell) == edited:
                        cell.source = "pass"
                mistaken.cells = [c for c in mistaken.cells if course.grade_id(c) != deleted]
            _submit(root, "mistake", assignment, name, mistaken)
            cheat = copy.deepcopy(nb)
            cheat.cells.insert(1 + next(i for i, c in enumerate(cheat.cells)
                                        if course.grade_id(c) == "imports"),
                               nbformat.v4.new_code_cell(PATCH_CELL))
            if assignment == SPEC:
                course.fill(cheat, dict([OWN_IMPLEMENTATION, PATCH_WHILE_CHECKED]))
            _submit(root, "cheat", assignment, name, cheat)
            if assignment == SPEC:
                raises = {**solutions, RAISES_EXERCISE: RAISE + solutions[RAISES_EXERCISE]}
                _submit(root, "raises", assignment, name, course.fill(copy.deepcopy(nb), raises))
                dead = course.fill(copy.deepcopy(nb), solutions)
                dead.cells.insert(1 + next(i for i, c in enumerate(dead.cells)
                                           if course.grade_id(c) == "imports"),
                                  nbformat.v4.new_code_cell(DEAD_KERNEL))
                _submit(root, "dead", assignment, name, dead)
    # Every student but the loop in one call, with the course's own time limits. The dead kernel
    # makes nbgrader drop that submission and exit with status 1 once the others are graded.
    autograde = nbgrader(["autograde", "*", "--create", "--force"], check=False)
    # The loop with 10 s limits (each limit is paid twice: in the kernel and in the fresh process).
    spec_nb = next(iter(released[SPEC]))
    solutions = course.solutions(SPEC)
    looping = {**solutions, LOOP_EXERCISE: _with_loop(solutions[LOOP_EXERCISE])}
    _submit(root, "loop", SPEC, spec_nb, course.fill(copy.deepcopy(released[SPEC][spec_nb]),
                                                   looping))
    nbgrader(["autograde", SPEC, "--student", "loop", "--create", "--force",
              "--Execute.timeout=10", "--IsolatedChecks.timeout=10"])
    nbgrader(["generate_feedback", "*", "--force"])
    nbgrader(["export", "--to", os.path.join(root, "grades.csv")])

    from nbgrader.api import Gradebook, MissingEntry
    points = {}
    with Gradebook("sqlite:///" + os.path.join(root, "gradebook.db"), "minivllm") as gb:
        for assignment, notebooks in released.items():
            for name, nb in notebooks.items():
                by_grade_id = {g: k for k, g in _exercises(nb).items()}
                for student in STUDENTS:
                    try:
                        sub = gb.find_submission_notebook(name[:-len(".ipynb")], assignment,
                                                          student)
                    except MissingEntry:     # loop, raises and dead submit spec_decode only
                        continue
                    points[student, assignment, name] = {
                        by_grade_id[g.name]: (g.score, g.max_score) for g in sub.grades}
    with open(os.path.join(root, "grades.csv")) as f:
        rows = list(csv.DictReader(f))
    exercises = {a: {k: nb_name for nb_name, nb in nbs.items() for k in _exercises(nb)}
                 for a, nbs in released.items()}
    manual = {}
    with Gradebook("sqlite:///" + os.path.join(root, "gradebook.db"), "minivllm") as gb:
        for name in released[SPEC]:
            sub = gb.find_submission_notebook(name[:-len(".ipynb")], SPEC, "dead")
            manual[name] = [g.needs_manual_grade for g in sub.grades]
    return root, points, exercises, rows, (time.monotonic() - t0, steps), (autograde, manual)


def _feedback(root, student, assignment, name) -> str:
    path = os.path.join(root, "feedback", student, assignment, name.replace(".ipynb", ".html"))
    with open(path) as f:
        return f.read()


def _autograded(root, student, assignment, name):
    return nbformat.read(os.path.join(root, "autograded", student, assignment, name),
                         as_version=4)


def _message(nb, grade_id: str) -> str:
    cell = next(c for c in nb.cells if course.grade_id(c) == grade_id)
    return "\n".join(o.get("evalue", "") + o.get("text", "") for o in cell.outputs)


def test_released_notebooks_are_generated(tmp_path):
    """notebooks/<nb>.ipynb are exactly what nbgrader's generate_assignment writes from the source
    notebooks (python -m minivllm.learn.exercises release regenerates them)."""
    written = course.release(out_dir=str(tmp_path))
    assert sorted(map(os.path.basename, written)) == sorted(
        os.path.basename(p) for paths in course.source_notebooks().values() for p in paths)

    def normal(path):
        return json.loads(nbformat.writes(nbformat.read(path, as_version=4)))
    for path in written:
        committed = os.path.join(course.NOTEBOOKS_DIR, os.path.basename(path))
        assert normal(path) == normal(committed), (
            f"{committed} is not nbgrader's release of its source notebook: run "
            "python -m minivllm.learn.exercises release")
        text = open(path).read()
        assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text


def test_every_test_cell_calls_a_registered_check_and_every_exercise_has_a_mistake():
    from minivllm.learn.exercises import EXERCISES
    answers = _answers()
    checked = {}
    for assignment, paths in course.source_notebooks().items():
        for path in paths:
            for cell in nbformat.read(path, as_version=4).cells:
                if is_test_cell(cell):
                    calls = [op for op in checks_of(cell.source) if "check" in op]
                    assert calls, f"{path}: {course.grade_id(cell)} calls no check"
                    for op in calls:
                        assert op["check"] == f"check_{op['arg']}", op
                        checked[op["arg"]] = assignment
    assert set(checked) <= set(EXERCISES), set(checked) - set(EXERCISES)
    for name, assignment in checked.items():
        assert EXERCISES[name].assignment == assignment, name
    assert set(answers) <= set(checked), set(answers) - set(checked)
    if {"spec_decode", "pd", "pd_at_scale"} <= set(course.source_notebooks()):
        assert set(EXERCISES) == set(checked) == set(answers), (
            set(EXERCISES) ^ set(checked), set(EXERCISES) - set(answers))


def test_the_reference_scores_full_marks(cycle):
    _, points, exercises, _, _, _ = cycle
    for (student, assignment, name), grades in points.items():
        if student == "ref":
            assert set(grades) == set(exercises[assignment]), (assignment, grades)
            assert all(score == top for score, top in grades.values()), (assignment, grades)


def test_each_mistake_costs_exactly_its_exercise_and_the_feedback_shows_its_hint(cycle):
    root, points, _, _, _, _ = cycle
    answers = _answers()
    for (student, assignment, name), grades in points.items():
        if student != "mistake":
            continue
        page = _text(_feedback(root, student, assignment, name))
        for exercise, (score, top) in grades.items():
            if exercise in answers:
                assert score == 0, (exercise, score)
                assert answers[exercise]["hint"] in page, (exercise, answers[exercise]["hint"])
            else:
                assert score == top, (exercise, score)


def test_an_edited_or_deleted_test_cell_gains_nothing(cycle):
    """The mistake student's edited (``pass``) and deleted test cells were restored and graded: the
    mistakes under them still score 0, as in every other cell."""
    root, points, exercises, _, _, _ = cycle
    name = next(iter(set(exercises[SPEC].values())))
    nb = _autograded(root, "mistake", SPEC, name)
    answers = _answers()
    mistaken = [k for k in exercises[SPEC] if k in answers][:2]
    cells = {course.grade_id(c): c for c in nb.cells}
    for exercise in mistaken:
        assert "cases=" in cells[f"{exercise}_test"].source      # the check, not `pass`
        assert points["mistake", SPEC, name][exercise][0] == 0
    assert "was missing from the submission" in cells[f"{mistaken[1]}_test"].source


def test_the_loop_times_out_and_the_rest_is_graded(cycle):
    root, points, exercises, _, _, _ = cycle
    name = exercises[SPEC][LOOP_EXERCISE]
    grades = points["loop", SPEC, name]
    assert grades[LOOP_EXERCISE][0] == 0
    assert all(score == top for k, (score, top) in grades.items() if k != LOOP_EXERCISE), grades
    message = _message(_autograded(root, "loop", SPEC, name), f"{LOOP_EXERCISE}_test")
    assert "ran past the 10 s time limit" in message, message


def test_a_cell_that_raises_costs_its_exercise_alone(cycle):
    root, points, exercises, _, _, _ = cycle
    name = exercises[SPEC][RAISES_EXERCISE]
    grades = points["raises", SPEC, name]
    assert grades[RAISES_EXERCISE][0] == 0
    assert all(score == top for k, (score, top) in grades.items() if k != RAISES_EXERCISE), grades


def test_the_cheat_scores_zero(cycle):
    """Patching the checks in the kernel changes nothing; calling the package's own implementation,
    or patching a helper while a check runs, scores 0 with a message saying why."""
    root, points, exercises, _, _, _ = cycle
    cheat = {key: grades for key, grades in points.items() if key[0] == "cheat"}
    assert {a for _, a, _ in cheat} == set(exercises)
    for key, grades in cheat.items():
        assert all(score == 0 for score, _ in grades.values()), (key, grades)
    nb = _autograded(root, "cheat", SPEC, exercises[SPEC][OWN_IMPLEMENTATION[0]])
    assert "the package's own implementation" in _message(nb, f"{OWN_IMPLEMENTATION[0]}_test")
    assert "a solution may not change the checks" in _message(
        nb, f"{PATCH_WHILE_CHECKED[0]}_test")
    patch_cell = next(c for c in nb.cells if "exercises.CHECKS.update" in c.source)
    said = "".join(o.get("text", "") for o in patch_cell.outputs)
    assert "ignored when graded: line 4, top-level expr `exercises.CHECKS.update(" in said, said


def test_a_dead_kernel_drops_the_submission(cycle):
    """os._exit in a cell: nbgrader logs the error, deletes that student's autograded folder,
    grades everyone else and exits with status 1; the gradebook keeps every test cell at 0,
    flagged for manual grading, and there is no feedback page (what nbgrader_config.py says)."""
    root, points, exercises, _, _, (autograde, manual) = cycle
    assert autograde.returncode == 1
    log = autograde.stdout + autograde.stderr
    assert "DeadKernelError" in log
    failed = re.findall(r"There was an error processing assignment '(\w+)' for student '(\w+)'",
                        log)
    assert set(failed) == {(SPEC, "dead")}, failed
    name = next(iter(set(exercises[SPEC].values())))
    assert not os.path.exists(os.path.join(root, "autograded", "dead", SPEC))
    assert not os.path.exists(os.path.join(root, "feedback", "dead", SPEC))
    assert all(score == 0 for score, _ in points["dead", SPEC, name].values())
    assert all(manual[name]), manual


def test_the_gradebook_csv_has_a_total_per_student_and_assignment(cycle):
    _, points, _, rows, _, _ = cycle
    totals = {}
    for (student, assignment, _), grades in points.items():
        totals[student, assignment] = totals.get((student, assignment), 0) + sum(
            score for score, _ in grades.values())
    exported = {(r["student_id"], r["assignment"]): float(r["score"]) for r in rows}
    for key, total in totals.items():
        assert exported[key] == pytest.approx(total), key


def test_the_feedback_page_leaves_out_the_hidden_tests(cycle):
    """nbgrader renders the autograded notebook, hidden tests included; the course's configuration
    removes their source (ClearHiddenTests), and their results (the failed case, its hint) stay."""
    root, _, exercises, _, _, _ = cycle
    name = next(iter(set(exercises[SPEC].values())))
    page = _text(_feedback(root, "mistake", SPEC, name))
    assert "HIDDEN TESTS" not in page and 'cases="hidden"' not in page
    assert 'cases="visible"' in page


def test_the_cycle_report(cycle, capsys):
    """The gradebook, points per exercise per student, and the time the whole cycle took."""
    root, points, _, _, (seconds, steps), _ = cycle
    with capsys.disabled():
        print(f"\ncourse cycle: {seconds:.0f} s (" + ", ".join(
            f"{step} {t:.0f} s" for step, t in steps.items()) + ")")
        for (student, assignment, _), grades in sorted(points.items()):
            print(f"  {student:8} {assignment:12} " + "  ".join(
                f"{k} {score:g}/{top:g}" for k, (score, top) in grades.items()))
    if os.environ.get("MINIVLLM_FEEDBACK_SCREENSHOT"):
        name = next(iter(set(cycle[2][SPEC].values())))
        page = os.path.join(root, "feedback", "mistake", SPEC, name.replace(".ipynb", ".html"))
        png = os.path.join(os.path.dirname(TESTS), "figures", "course_feedback.png")
        course.screenshot(page, png, width=1000, height=1900)
        assert os.path.getsize(png) > 10_000


# ------------------------------------------------------------ the isolated grading, piece by piece
def test_only_definitions_are_graded_and_what_is_dropped_is_said():
    from minivllm.learn.exercises.isolate import student_statements
    source = ("import torch\nfrom minivllm.learn import exercises\nLIMIT = 3\n"
              "NAMES: tuple = ('a',)\n"
              "exercises.CHECKS.update({})\nexercises.spec._fail = print\nx = len([1])\n"
              "for i in range(2):\n    pass\n\n@staticmethod\ndef f(a, b=LIMIT):\n"
              "    return a\n\nclass C:\n    pass\n")
    kept, notes = student_statements(source)
    assert [k["line"] for k in kept] == [1, 2, 3, 4, 11, 15]
    assert kept[4]["source"].startswith("@staticmethod\ndef f(")      # its decorator with it
    assert [n.split(",")[0] for n in notes] == [f"ignored when graded: line {n}"
                                                 for n in (5, 6, 7, 8)]
    assert "`exercises.CHECKS.update({})`" in notes[0]
    kept, notes = student_statements(source, stop=6)       # the cell raised at line 6 when it ran
    assert [k["line"] for k in kept] == [1, 2, 3, 4]
    assert "line 6 onwards" in notes[-1] and "line 5, top-level expr" in notes[0]
    kept, notes = student_statements("def f(:\n")
    assert kept == [] and "does not parse" in notes[0]


def _job(*cells: str):
    """Student cells (index 0, 2, ...) each followed by a test cell that checks walk_suffix_tree
    and then num_blocks_to_allocate (visible cases)."""
    from minivllm.learn.exercises.isolate import GradedCell, checks_of, student_statements
    students, graded = [], []
    for i, source in enumerate(cells):
        students.append({"index": 2 * i, "statements": student_statements(source)[0]})
        name = ("walk_suffix_tree", "num_blocks_to_allocate")[i % 2]
        graded.append(GradedCell(grade_id=f"{name}_test", cell=2 * i + 1, ops=checks_of(
            f"exercises.check_{name}({name}, cases=\"visible\")")))
    return students, graded


def test_a_print_cannot_fake_a_pass_and_a_dead_process_fails_one_exercise(tmp_path):
    """A student's print of a pass line (on sys.stdout and on file descriptor 1) is ignored; a
    solution that kills its process fails that exercise alone: a fresh process grades the next."""
    from minivllm.learn.exercises.isolate import run_isolated
    solutions = course.solutions(SPEC)
    faker = ("import os, json\nfrom minivllm.learn import exercises\n"
             "def walk_suffix_tree(node, max_tokens, min_token_prob):\n"
             "    line = json.dumps({'grade_id': 'walk_suffix_tree_test', 'passed': True})\n"
             "    print('0' * 32 + ' ' + line)\n    os.write(1, (line + '\\n').encode())\n"
             "    os._exit(0)\n")
    students, graded = _job(faker, solutions["num_blocks_to_allocate"])
    results = run_isolated(students, graded, str(tmp_path), timeout=60)
    assert [r.grade_id for r in results] == ["walk_suffix_tree_test", "num_blocks_to_allocate_test"]
    assert not results[0].passed and "died" in results[0].message, results[0]
    assert results[1].passed and results[1].stdout.startswith("\u2713"), results[1]


def test_a_patch_made_while_a_check_runs_fails_that_exercise_and_the_next(tmp_path):
    """A solution that empties the registry and replaces a check while its own check runs: the
    fresh process looked its checks up before any student code ran, and the snapshot names what
    changed, for that exercise and every one after it."""
    from minivllm.learn.exercises.isolate import run_isolated
    patcher = ("from minivllm.learn import exercises\n"
               "def walk_suffix_tree(node, max_tokens, min_token_prob):\n"
               "    import minivllm.learn.exercises.registry as registry\n"
               "    registry.EXERCISES.clear()\n"
               "    exercises.check_num_blocks_to_allocate = lambda fn, cases='all': None\n"
               "    return [], []\n")
    students, graded = _job(patcher, "x = 1\n")        # num_blocks_to_allocate never written
    results = run_isolated(students, graded, str(tmp_path), timeout=60)
    for result in results:
        assert not result.passed
        assert "your code changed minivllm.learn.exercises.registry.EXERCISES" in result.message
        assert "exercises.check_num_blocks_to_allocate" in result.message
        assert "a solution may not change the checks" in result.message


def test_the_teachers_readme_names_every_exercise():
    readme = open(os.path.join(course.COURSE_DIR, "README.md")).read()
    for assignment, paths in course.source_notebooks().items():
        assert f"`{assignment}`" in readme, assignment
        for path in paths:
            for name in _exercises(nbformat.read(path, as_version=4)):
                assert f"`{name}`" in readme, name
