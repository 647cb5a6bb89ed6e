"""The exercise checks fail on the naive answers a learner writes first (issue: "the checks pass a
NaN residual and a producer that never loads under kv_both"), and name the learner's own class.

The spec_decode assignment's checks, all of them: the reference solution (the solution cells of
notebooks/course/source/spec_decode/04_exercises.ipynb) passes every case and writes nothing on
stderr; each common mistake (tests/course_answers_spec.py) is stopped with its hint, by the
hidden cases where the visible ones let it pass; a solution that calls the package's own
implementation of its step fails with that reason; the released stubs say "not written yet"; and
the source notebook, hidden tests included, runs clean top to bottom in a kernel. The P/D checks are in test_exercise_checks_pd.py."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from minivllm.learn import exercises
from minivllm.learn.exercises import ExerciseCheckError
from minivllm.learn.exercises.course import solutions
from minivllm.learn.exercises.registry import EXERCISES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from course_answers_spec import ANSWERS, MISTAKES  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(REPO, "notebooks", "course", "source", "spec_decode", "04_exercises.ipynb")
RELEASE = os.path.join(REPO, "notebooks", "04_exercises.ipynb")
SPEC = sorted(name for name, e in EXERCISES.items() if e.assignment == "spec_decode")
REFERENCE = solutions("spec_decode")
NEW = ("accept_reject", "rejection_gives_back", "dynamic_k", "block_verification")


def define(name: str, source: str, label: str):
    """What a notebook cell defines: ``source`` compiled as a file of its own (``label``), with
    the import cell's names."""
    namespace: dict = {}
    exec(compile("import torch\n\n" + source, f"<{label}>", "exec"), namespace)
    return namespace[name]


def grade(name: str, fn) -> str:
    """What the test cell does: the visible cases, then the hidden ones. -> "" when both pass,
    else the first failure's message."""
    for cases in ("visible", "hidden"):
        try:
            EXERCISES[name].run(fn, cases=cases)
        except ExerciseCheckError as e:
            return str(e)
    return ""


def test_every_spec_exercise_has_one_solution_cell_answers_and_named_mistakes():
    """The registry, the source notebook's solution cells and the answers name the same nine
    exercises; a new exercise names at least two mistakes its hidden cases catch, and its
    solution takes 30 lines or fewer."""
    assert sorted(REFERENCE) == SPEC == sorted(ANSWERS) == sorted(MISTAKES)
    assert len(SPEC) == 9 and set(NEW) <= set(SPEC)
    for name in NEW:
        assert len(EXERCISES[name].mistakes) >= 2, name
        assert len([ln for ln in REFERENCE[name].splitlines() if ln.strip()]) <= 30, name
        assert sum(m.visible for m in MISTAKES[name]) >= 2, name
    assert [n for n in SPEC if EXERCISES[n].optional] == ["block_verification"]


@pytest.mark.parametrize("name", SPEC)
def test_the_reference_solution_passes_every_case_quietly(name, capsys):
    fn = define(name, REFERENCE[name], f"solution {name}")
    for cases in ("visible", "hidden", "all"):
        assert EXERCISES[name].run(fn, cases=cases) is None
        out, err = capsys.readouterr()
        assert err == "", err
        assert out.count("\n") == 1 and out.startswith(f"\u2713 {name}: "), out


MISTAKE_CASES = [(name, i) for name in sorted(MISTAKES) for i in range(len(MISTAKES[name]))]


@pytest.mark.parametrize("name,i", MISTAKE_CASES,
                         ids=[f"{n}-{MISTAKES[n][i].what[:40]}" for n, i in MISTAKE_CASES])
def test_each_common_mistake_is_stopped_with_its_hint(name, i, capsys):
    """The test cell stops the mistake with the check's hint and the case it failed; a mistake
    marked ``visible`` passes the visible cases (only the hidden ones catch it)."""
    mistake = MISTAKES[name][i]
    fn = define(name, mistake.source, f"mistake {name} {i}")
    message = grade(name, fn)
    assert message, f"{name}: the mistake '{mistake.what}' passes every case"
    assert mistake.hint in message, message
    assert "case" in message
    try:
        EXERCISES[name].run(fn, cases="visible")
        passed_visible = True
    except ExerciseCheckError:
        passed_visible = False
    assert passed_visible == mistake.visible, (mistake.what, passed_visible)
    assert capsys.readouterr().err == ""


def test_the_answers_are_each_exercises_first_mistake():
    for name, answer in ANSWERS.items():
        assert answer == {"mistake": MISTAKES[name][0].source, "hint": MISTAKES[name][0].hint}
        assert MISTAKES[name][0].visible, name   # a mistake only the hidden cases catch


# A solution that calls the engine's own implementation of the step (imported inside the function,
# or at the top of its cell before the check runs).
CHEATS = {
    "propose_last_match": """
def propose_last_match(context, min_n, max_n, k):
    from minivllm.spec_decode.ngram_proposer import NgramProposer
    return NgramProposer(min_n, max_n, k, match="last").propose(context)
""",
    "num_blocks_to_allocate": """
from minivllm.learn.exercises.spec import _allocate_slots_reference

def num_blocks_to_allocate(num_computed_tokens, num_new_tokens, num_lookahead_tokens,
                           num_held_blocks, block_size, max_model_len):
    return _allocate_slots_reference(num_computed_tokens, num_new_tokens, num_lookahead_tokens,
                                     num_held_blocks, block_size, max_model_len)
""",
    "spec_decode_logits_indices": """
def spec_decode_logits_indices(num_scheduled_tokens, num_draft_tokens):
    from minivllm.learn.exercises.spec import reference_spec_decode_logits_indices
    return reference_spec_decode_logits_indices(num_scheduled_tokens, num_draft_tokens)
""",
    "accept_reject": """
from minivllm.sample.rejection_reference import accept_or_recover

def accept_reject(draft_token_ids, p_draft, p_target, uniforms, recovered_token_ids,
                  bonus_token_id):
    accepted, rejected = accept_or_recover(draft_token_ids, p_draft, p_target, uniforms)
    if rejected is None:
        return accepted + [bonus_token_id]
    return accepted + [recovered_token_ids[len(accepted)]]
""",
    "residual_distribution": """
from minivllm.sample.rejection_block import block_residual

def residual_distribution(p_target, p_draft):
    residual = block_residual(p_target[None], p_draft[None], torch.tensor([0]),
                              torch.ones(1, dtype=p_target.dtype))[0]
    return residual / residual.sum() if residual.sum() > 0 else p_target
""",
    "rejection_gives_back": """
def rejection_gives_back(num_computed_tokens, scheduled_spec_token_ids, sampled_token_ids,
                         num_held_blocks, block_size):
    from minivllm.learn.exercises.verify import _scheduler_after_verify
    drafts = list(scheduled_spec_token_ids)
    run = _scheduler_after_verify(num_computed_tokens - len(drafts) - 1, drafts,
                                  len(sampled_token_ids) - 1, block_size)
    return run["expected"]
""",
    "dynamic_k": """
from minivllm.spec_decode.dynamic import build_dynamic_sd_schedule_lookup

def dynamic_k(schedule, num_speculative_tokens, batch_size):
    lookup = build_dynamic_sd_schedule_lookup(schedule, batch_size, num_speculative_tokens)
    return lookup[batch_size]
""",
    "walk_suffix_tree": """
from minivllm.spec_decode.suffix_tree import Node, SuffixTree

def walk_suffix_tree(node, max_tokens, min_token_prob):
    def build(token, d):
        n = Node(token=token, count=d["count"])
        n.ranked = [build(t, c) for t, c in d["children"]]
        n.children = {c.token: c for c in n.ranked}
        return n
    draft = SuffixTree(max_depth=8).walk(build(-1, node), max_tokens, min_token_prob)
    return draft.token_ids, draft.probs
""",
    "block_verification": """
def block_verification(draft_token_ids, p_draft, p_target, uniforms):
    from minivllm.sample.rejection_block import joint_ratios_and_thresholds
    from minivllm.sample.rejection_reference import block_verify
    p, h = joint_ratios_and_thresholds([2], torch.tensor(draft_token_ids), p_draft, p_target)
    return p, h, len(block_verify(draft_token_ids, p_draft, p_target, uniforms)[0])
""",
}


@pytest.mark.parametrize("name", SPEC)
def test_a_solution_calling_the_package_implementation_scores_0(name, capsys):
    assert sorted(CHEATS) == SPEC
    fn = define(name, CHEATS[name], f"cheat {name}")
    with pytest.raises(ExerciseCheckError, match="package's own implementation") as e:
        EXERCISES[name].run(fn, cases="visible")
    assert "scores 0" in str(e.value)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", SPEC)
def test_a_raising_solution_is_reported_with_its_case(name):
    def broken(**kwargs):
        return 1 / 0
    with pytest.raises(ExerciseCheckError, match="raised ZeroDivisionError") as e:
        EXERCISES[name].run(broken, cases="visible")
    assert "case:" in str(e.value) and f"{name}(" in str(e.value)


def _nbgrader_cells(path: str) -> dict[str, dict]:
    import json
    with open(path, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    return {c["metadata"]["nbgrader"]["grade_id"]: c for c in cells}


def _text(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_the_release_holds_the_stubs_and_the_visible_tests_only():
    """notebooks/04_exercises.ipynb is nbgrader's release of the source notebook: the same cells,
    each solution a stub that says "not written yet" to its check, no hidden test; 2 points per
    exercise; the first cell gives the number of exercises."""
    source, release = _nbgrader_cells(SOURCE), _nbgrader_cells(RELEASE)
    assert list(source) == list(release)
    for name in SPEC:
        test = _text(release[f"{name}_test"])
        assert test == f'exercises.check_{name}({name}, cases="visible")', test
        assert release[f"{name}_test"]["metadata"]["nbgrader"]["points"] == 2
        hidden = _text(source[f"{name}_test"])
        assert re.search(r"### BEGIN HIDDEN TESTS\n# catches: .+\n"
                         rf'exercises.check_{name}\({name}, cases="hidden"\)\n'
                         r"### END HIDDEN TESTS$", hidden), hidden
        stub = _text(release[name])
        assert "### BEGIN SOLUTION" not in stub and "raise NotImplementedError()" in stub
        with pytest.raises(ExerciseCheckError, match="not written yet"):
            EXERCISES[name].run(define(name, stub, f"stub {name}"), cases="visible")
    whole = open(RELEASE, encoding="utf-8").read()
    assert "HIDDEN TESTS" not in whole and 'cases=\\"hidden\\"' not in whole
    assert "Nine small functions" in _text(release["04_exercises-1"])


def test_the_source_notebook_runs_clean_top_to_bottom():
    """In a kernel, hidden tests included: every test cell prints two ✓ lines (its visible and
    its hidden cases) and nothing on stderr (nbgrader scores a cell with stderr 0)."""
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from minivllm.learn.notebooks import execute
    nb = execute(nbformat.read(SOURCE, as_version=4))
    graded = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert len(graded) == len(SPEC)
    for cell in graded:
        streams = [o for o in cell.outputs if o.output_type == "stream"]
        assert all(o.name == "stdout" for o in streams), cell.outputs
        assert "".join(o.text for o in streams).count("\u2713") == 2, cell.outputs
        assert not [o for o in cell.outputs if o.output_type in ("error", "execute_result")]


def test_residual_check_uses_the_package_sampler():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    freq = exercises._residual_reference_frequencies(p, q)
    assert torch.allclose(freq, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def test_the_guard_leaves_the_callers_frames_alone(capsys):
    """A check called from the file that defines the solution (a notebook cell that defines the
    function and calls its check) is not taken for the solution calling the package's sampler:
    only the frames below the check count."""
    def residual_distribution(p_target, p_draft):
        residual = (p_target - p_draft).clamp_min(0)
        total = residual.sum()
        return residual / total if total > 0 else p_target.clone()
    assert exercises.check_residual_distribution(residual_distribution, cases="hidden") is None
    assert "\u2713 residual_distribution" in capsys.readouterr().out


def naive_residual(p_target, p_draft):
    residual = (p_target - p_draft).clamp_min(0)
    return residual / residual.sum()          # 0 / 0 = NaN when p_draft == p_target


def residual_with_convention(p_target, p_draft):
    residual = (p_target - p_draft).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else p_target.clone()


def test_the_residual_check_fails_on_nan_and_states_the_convention(capsys):
    with pytest.raises(ExerciseCheckError, match="draft equals target") as e:
        exercises.check_residual_distribution(naive_residual)
    assert "NaN" in str(e.value) and "return p_target itself" in str(e.value)
    assert exercises.check_residual_distribution(residual_with_convention) is None


def test_the_residual_check_names_a_renamed_parameter():
    def renamed(p, q):
        return residual_with_convention(p, q)
    with pytest.raises(ExerciseCheckError, match="TypeError.*p_target"):
        exercises.check_residual_distribution(renamed)


def num_chunks(num_prompt_tokens, block_size=16, chunk_size=64):
    """Notebook 03's exercise "how many chunks does a prompt of n tokens match?", solved."""
    stored = (num_prompt_tokens - 1) // block_size * block_size   # whole blocks below the last token
    return -(-stored // chunk_size)                                # ceil


def test_notebook_03_chunks_solution_agrees_with_the_connector():
    """The exercise ships unsolved; its solution (above) gives the connector's own count."""
    from types import SimpleNamespace
    from minivllm.distributed.kv_transfer.redis_store_connector import RedisStoreConnector
    stand_in = SimpleNamespace(_block_size=16, _chunk_size=64)
    for n in (1, 16, 17, 64, 65, 80, 81, 200, 1000):
        assert num_chunks(n) == RedisStoreConnector.num_prompt_chunks(stand_in, n), n


def _walk(rule):
    """A greedy walk by frequency; ``rule(prob, ratio, min_token_prob)`` -> (keep?, prob shown)."""
    def walk_suffix_tree(node, max_tokens, min_token_prob):
        tokens, probs, prob = [], [], 1.0
        while len(tokens) < max_tokens and node["children"]:
            token, child = node["children"][0]
            ratio = child["count"] / node["count"]
            prob *= ratio
            keep, shown = rule(prob, ratio, min_token_prob)
            if not keep:
                break
            tokens.append(token)
            probs.append(shown)
            node = child
        return tokens, probs
    return walk_suffix_tree


def test_the_suffix_walk_check_names_the_case_and_hints_at_the_common_mistakes(capsys):
    """A per-step ratio fails on the running-product case with the per-step hint; `<=` at the
    boundary fails on the case exactly at min_token_prob with the boundary hint; the right rule
    passes every case."""
    per_step = _walk(lambda prob, ratio, m: (ratio >= m, ratio))
    with pytest.raises(ExerciseCheckError, match=r"(?s)case 'the running product.*hint: these "
                                                 r"are per-step ratios"):
        exercises.check_walk_suffix_tree(per_step)
    at_most = _walk(lambda prob, ratio, m: (prob > m, prob))
    with pytest.raises(ExerciseCheckError, match=r"(?s)case 'a probability exactly min_token_prob"
                                                 r".*hint: stopped at a probability equal"):
        exercises.check_walk_suffix_tree(at_most)
    assert exercises.check_walk_suffix_tree(_walk(lambda prob, ratio, m: (prob >= m, prob))) is None
    assert "8 hand-made cases and 200 cases" in capsys.readouterr().out


def test_the_suffix_check_keeps_its_answers_as_data():
    """No importable solution: the expected walks are the check's case table (and the engine's
    SuffixTree.walk for the random trees), and every case says what it tests."""
    from minivllm.learn.exercises import suffix
    assert not [n for n in dir(suffix) if n.startswith("reference")]
    labels = [case[0] for case in suffix.HAND_CASES]
    assert len(set(labels)) == len(labels)
    assert any(c[3] in c[5] for c in suffix.HAND_CASES)       # a probability == min_token_prob
