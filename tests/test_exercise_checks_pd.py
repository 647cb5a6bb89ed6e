"""The checks of the assignments ``pd`` (notebook 07) and ``pd_at_scale`` (notebook 09): the
reference solutions, taken from the source notebooks' solution cells, pass every case; each mistake
the hidden cases are there for fails with its hint; a solution that calls the package's own
implementation of its step fails; a passing check prints one ✓ line, returns None and writes
nothing on stderr. Engine runs share one tiny random model per process."""
from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest

from minivllm.learn import exercises
from minivllm.learn.exercises.course import COURSE_DIR, solutions
from minivllm.learn.exercises.registry import EXERCISES, ExerciseCheckError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from course_answers_pd import ANSWERS, ASSIGNMENTS, MISTAKES, mistaken  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = sorted(n for n, e in EXERCISES.items() if e.assignment in ASSIGNMENTS)
SOURCES = {"pd": "pd/07_pd_exercises.ipynb",
           "pd_at_scale": "pd_at_scale/09_pd_at_scale_exercises.ipynb"}
RELEASES = {"pd": "07_pd_exercises.ipynb", "pd_at_scale": "09_pd_at_scale_exercises.ipynb"}


def _imports(assignment: str) -> str:
    nb = nbformat.read(os.path.join(COURSE_DIR, "source", SOURCES[assignment]), as_version=4)
    return next(c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id")
                == "imports")


def define(name: str, source: str):
    """What a notebook defines when its imports cell and this solution cell run: each cell is a
    file of its own to Python, as in a kernel."""
    namespace: dict = {}
    assignment = EXERCISES[name].assignment
    exec(compile(_imports(assignment), f"<{assignment} imports>", "exec"), namespace)
    exec(compile(source, f"<{name} cell>", "exec"), namespace)
    return namespace[name]


@pytest.fixture(scope="module")
def references() -> dict[str, str]:
    return {name: src for a in ASSIGNMENTS for name, src in solutions(a).items()}


def test_every_exercise_has_a_solution_cell_a_test_cell_and_two_mistakes(references):
    assert sorted(references) == NAMES == sorted(ANSWERS)
    for assignment, path in SOURCES.items():
        nb = nbformat.read(os.path.join(COURSE_DIR, "source", path), as_version=4)
        tests = {c.metadata["nbgrader"]["grade_id"]: c.source for c in nb.cells
                 if c.metadata.get("nbgrader", {}).get("grade")}
        for name in (n for n in NAMES if EXERCISES[n].assignment == assignment):
            assert len(EXERCISES[name].mistakes) >= 2, name
            assert {m[0] for m in MISTAKES if m[0] == name}, name
            assert tests[f"{name}_test"].startswith(
                f'exercises.check_{name}({name}, cases="visible")\n### BEGIN HIDDEN TESTS\n'
                "# catches: "), tests[f"{name}_test"]
        first = nb.cells[0].source
        number = {"pd": "Three exercises", "pd_at_scale": "Three exercises"}[assignment]
        assert number in first and len(tests) == 3


@pytest.mark.parametrize("name", NAMES)
def test_the_reference_solution_passes_every_case_quietly(name, references, capfd):
    fn = define(name, references[name])
    for cases in ("visible", "hidden", "all"):
        assert EXERCISES[name].run(fn, cases=cases) is None
        out, err = capfd.readouterr()
        assert out.count("\u2713") == 1 and out.startswith(f"\u2713 {name}"), out
        assert err == "", err


@pytest.mark.parametrize("mistake", MISTAKES, ids=[f"{m[0]}: {m[1]}" for m in MISTAKES])
def test_each_mistake_fails_with_its_hint(mistake, capfd):
    name, _, edits, visible_passes, hint = mistake
    fn = define(name, mistaken(name, edits))
    if visible_passes:     # a mistake the hidden cases are there for
        EXERCISES[name].run(fn, cases="visible")
        with pytest.raises(ExerciseCheckError) as e:
            EXERCISES[name].run(fn, cases="hidden")
    else:
        with pytest.raises(ExerciseCheckError) as e:
            EXERCISES[name].run(fn, cases="visible")
    assert hint in str(e.value), str(e.value)
    with pytest.raises(ExerciseCheckError) as e:
        EXERCISES[name].run(fn, cases="all")
    assert hint in str(e.value)
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("name", NAMES)
def test_the_answers_cost_their_exercise_and_show_the_hint(name):
    fn = define(name, ANSWERS[name]["mistake"])
    EXERCISES[name].run(fn, cases="visible")
    with pytest.raises(ExerciseCheckError) as e:
        EXERCISES[name].run(fn, cases="hidden")
    assert ANSWERS[name]["hint"] in str(e.value)


CALLS_THE_PACKAGE = {
    "decode_load_plan": '''
def decode_load_plan(block_size, num_prompt_tokens, num_local_hit_tokens):
    from minivllm.distributed.kv_transfer.storage import align_to_block_size
    stored = align_to_block_size(num_prompt_tokens, block_size)
    return (list(range(num_local_hit_tokens, stored)),
            list(range(max(stored, num_local_hit_tokens), num_prompt_tokens)))
''',
    "MyKVConnector": '''
class MyKVConnector(exercises.InMemoryConnector):
    _stored_prefix = exercises.InMemorySchedulerConnector._stored_prefix

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return exercises.InMemorySchedulerConnector.get_num_new_matched_tokens(
            self, request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return exercises.InMemorySchedulerConnector.update_state_after_alloc(
            self, request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return exercises.InMemorySchedulerConnector.build_connector_meta(self, scheduler_output)
''',
    "MyWorkerConnector": '''
class MyWorkerConnector(exercises.InMemorySchedulerConnector):
    _slots = exercises.InMemoryConnector._slots

    def start_load_kv(self, forward_context, **kwargs):
        exercises.InMemoryConnector.start_load_kv(self, forward_context, **kwargs)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        exercises.InMemoryConnector.save_kv_layer(self, layer_name, kv_layer, attn_metadata)

    def wait_for_save(self):
        exercises.InMemoryConnector.wait_for_save(self)
''',
    "block_hashes": '''
def block_hashes(token_ids, block_size, cache_salt=None):
    from minivllm.disagg.fleet.kv_index import prompt_block_hashes
    return prompt_block_hashes(token_ids, block_size)
''',
    "pick_replica": '''
def pick_replica(prompt_hashes, replicas, weight=1.0):
    from minivllm.disagg.fleet import kv_index
    index = kv_index.KVIndex()
    candidates = [kv_index.Candidate(r, 0, s["blocks_in_use"], s["num_ongoing"])
                  for r, s in sorted(replicas.items())]
    best = kv_index.pick(candidates, len(prompt_hashes), weight)
    return (best.replica if best else None), {c.replica: c.score for c in candidates}
''',
    "needs_remote_prefill": '''
def needs_remote_prefill(num_prompt_tokens, cached_blocks, block_size, pd_min_uncached_tokens):
    from minivllm.disagg.fleet.kv_index import needs_remote_prefill as decide
    return decide(num_prompt_tokens, cached_blocks, block_size, pd_min_uncached_tokens)
''',
}


@pytest.mark.parametrize("name", NAMES)
def test_calling_the_package_own_implementation_fails(name, capfd):
    fn = define(name, CALLS_THE_PACKAGE[name])
    with pytest.raises(ExerciseCheckError, match="the package's own implementation"):
        EXERCISES[name].run(fn, cases="visible")
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_the_released_stubs_are_not_written_yet(assignment):
    """The student's notebook, as nbgrader released it: no solution, no hidden case, and each
    exercise's stub stops its visible check with "not written yet"."""
    nb = nbformat.read(os.path.join(REPO, "notebooks", RELEASES[assignment]), as_version=4)
    text = "".join(c.source for c in nb.cells)
    assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
    stubs = {c.metadata["nbgrader"]["grade_id"]: c.source for c in nb.cells
             if c.metadata.get("nbgrader", {}).get("solution")}
    assert sorted(stubs) == sorted(n for n in NAMES if EXERCISES[n].assignment == assignment)
    for name, source in stubs.items():
        with pytest.raises(ExerciseCheckError, match="not written yet"):
            EXERCISES[name].run(define(name, source), cases="visible")


def test_the_connector_check_names_the_learners_class():
    """The literal reading of "a producer always answers 0", wrong under kv_both, in a class of
    the learner's own name: the message names that class and the rule."""
    source = mistaken("MyKVConnector", [("if not self.is_consumer or", "if self.is_producer or")])
    fn = define("MyKVConnector", source.replace("class MyKVConnector(", "class ProducerNeverLoads(")
                + "\nMyKVConnector = ProducerNeverLoads\n")
    with pytest.raises(ExerciseCheckError) as e:
        exercises.check_MyKVConnector(fn, cases="hidden")
    text = str(e.value)
    assert "ProducerNeverLoads.get_num_new_matched_tokens" in text and "kv_both" in text, text
    assert "MyKVConnector" not in text


def test_importing_the_exercises_imports_neither_ray_nor_the_fleet():
    code = ("import sys, minivllm.learn.exercises; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray' "
            "or m.startswith('minivllm.disagg')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO), check=True).stdout
    assert out.strip() == "[]", out
