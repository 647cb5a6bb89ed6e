"""The article, readable: every tour stop lands in a short function that names no vLLM-0.32 mode
and no performance route, and the then-and-now table resolves to real overrides."""
from __future__ import annotations

import os
import re

import pytest

import code_stats
from minivllm import steps
from minivllm.learn import then_and_now, tour

MAX_CODE_LINES = 40
# Names a reader of the article should not meet at a tour stop: vLLM 0.32's modes and fast paths.
FORBIDDEN = re.compile(r"vllm_today|async_scheduling|defer_finalize|probabilistic|placeholder|"
                       r"kernel_choice|onednn|packed|route|cpu_attn")
# Stops whose function is still over the limit: each entry must really be over it (the list can
# only shrink), and every other stop must be within it.
KNOWN_LONG: set[str] = set()

STOPS = sorted({(steps.REGISTRY[i].function, steps.REGISTRY[i].file)
                for part in ("spec", "pd") for i in tour.TOURS[part]})


@pytest.mark.parametrize("function,file", STOPS)
def test_tour_stop_is_short_and_plain(function, file):
    func = code_stats.resolve(function, file)
    n = code_stats.code_lines(func)
    if function in KNOWN_LONG:
        assert n > MAX_CODE_LINES, f"{function} is {n} lines now: drop it from KNOWN_LONG"
    else:
        assert n <= MAX_CODE_LINES, f"{function}: {n} code lines (at most {MAX_CODE_LINES})"
    found = FORBIDDEN.findall(code_stats.code_text(func))
    assert not found, f"{function} names {sorted(set(found))}"


def test_code_lines_counts_the_body_only():
    def f(x):
        """Doc.

        More doc."""
        # a comment
        y = x + 1

        return y
    assert code_stats.code_lines(f) == 2


@pytest.mark.parametrize("row", then_and_now.THEN_AND_NOW, ids=lambda r: f"{r[0]}:{r[2].split('.')[-1]}")
def test_then_and_now_rows_resolve_to_a_real_override(row):
    step_id, article, today, _ = row
    assert step_id in steps.REGISTRY
    lines = then_and_now.diff(article, today)
    assert any(l.startswith("+") and not l.startswith("+++") for l in lines)
    assert any(l.startswith("-") and not l.startswith("---") for l in lines)


def test_overlays_are_chosen_from_the_configuration(tiny_llama_dir, tmp_path):
    from conftest import runner_of, tiny_llm
    from minivllm.config import KVTransferConfig
    from minivllm.worker.model_runner import ModelRunner
    from minivllm.worker.vllm_today.async_scheduling import AsyncSchedulingMixin
    from minivllm.worker.vllm_today.kv_connector_context import VllmTodayKVConnectorMixin
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
             "prompt_lookup_min": 2}
    assert type(runner_of(tiny_llm(tiny_llama_dir, ngram))) is ModelRunner
    runner = runner_of(tiny_llm(tiny_llama_dir, ngram, async_scheduling=True))
    assert isinstance(runner, AsyncSchedulingMixin) and isinstance(runner, ModelRunner)
    ktc = KVTransferConfig("SharedStorageConnector", "kv_both",
                           {"shared_storage_path": str(tmp_path)}, kv_connector_context="vllm_today")
    runner = runner_of(tiny_llm(tiny_llama_dir, kv_transfer_config=ktc))
    assert isinstance(runner, VllmTodayKVConnectorMixin)
    assert not isinstance(runner, AsyncSchedulingMixin)


# The walks (code_stats.walks; `python tests/code_stats.py` lists them): what a reader stepping
# through one n-gram verify step, and through one P/D consumer request with SharedStorageConnector,
# walks through, found by running it with a line tracer: files entered, distinct lines executed,
# functions entered. Ratchets: lower a ceiling when a walk gets shorter, never raise it. A file counts
# when a line in it runs, so splitting a function into a file of its own can only raise them; they
# fall by taking work the step does not need off its path.
# Before the bodies went back to their names: verify 36 files, 781 lines, 162 functions; P/D 36
# files, 1,052 lines, 221 functions. The goals: verify at most 27 files, P/D at most 29.
WALK_CEILINGS = {
    # 720 lines and 149 functions until ModelRunner.num_spec_tokens_to_schedule (one line, one
    # call) let dynamic k override k alone instead of a copy of propose_draft_token_ids; 717 lines
    # since the methods went back to their classes (Scheduler._make_cached_request_data tests
    # `req in resumed_reqs` in its `if`; the rejection sampler calls its backend by keyword once
    # per path; RMSNorm picks its forward when its weight moves, not per call).
    "verify": {"files": 27, "lines": 717, "functions": 150},
    # 1058 lines and 219 functions until LLM.generate froze the GC heap around its steps
    # (utils.frozen_gc_heap, vLLM's freeze_gc_heap: 0.35 s less of full collections per run of
    # bench vllm's 8-request suffix workload); 1062 since the methods went back to their classes.
    "pd": {"files": 29, "lines": 1062, "functions": 220},
}


@pytest.fixture(scope="module")
def walked(smollm2_dir) -> dict[str, dict]:
    """On the default model: its drafts come from its own repetition of the prompt, which a random
    tiny checkpoint does not do."""
    return code_stats.walks(smollm2_dir)


@pytest.mark.parametrize("walk", sorted(WALK_CEILINGS))
def test_walk_ratchet(walk, walked):
    found = walked[walk]
    for key, ceiling in WALK_CEILINGS[walk].items():
        n = len(found["files"]) if key == "files" else found[key]
        assert n <= ceiling, (f"the {walk} walk: {n} {key} (at most {ceiling}); files in the "
                              f"order entered: {found['files']}")
    extras = [f for f in found["files"] if f.split("/")[0] in ("learn", "bench", "train", "disagg")
              or "vllm_today" in f or f in ("steps.py", "step_table.py")]
    assert not extras, f"the {walk} walk entered {extras}"


# Files a walk may enter that vLLM does not have: each is named in the README with its reason.
def _readme_layout() -> str:
    with open(os.path.join(code_stats.ROOT, "README.md")) as fh:
        text = fh.read()
    return text[text.index("## Layout"):]


@pytest.mark.parametrize("walk", sorted(WALK_CEILINGS))
def test_every_file_a_walk_enters_mirrors_a_vllm_file(walk, walked):
    """Each file the walk enters names the vLLM file (or folder) it mirrors in its docstring, or
    is a model layer or an attention / rejection-sampler backend, or the README's reading order
    names it with its reason; and the reading order lists every file the walk enters."""
    import ast
    layout = _readme_layout()
    unnamed = []
    for f in walked[walk]["files"]:
        with open(os.path.join(code_stats.ROOT, "minivllm", f)) as fh:
            doc = ast.get_docstring(ast.parse(fh.read())) or ""
        layer_or_backend = f.startswith(("model_executor/", "attention/", "sample/rejection_"))
        if not (re.search(r"\bvllm/[\w/]+", doc) or layer_or_backend or f"`{f}` (" in layout):
            unnamed.append(f)
        if walk == "verify" and not layer_or_backend:
            assert f"`{f}`" in layout, f"README's reading order does not list {f}"
    assert not unnamed, f"files of the {walk} walk that mirror no vLLM file: {unnamed}"


def test_file_code_lines_skips_docstrings_comments_and_blanks(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""Module doc."""\nimport os  # why\n\n\nclass A:\n    """Doc,\n    two lines."""\n'
                    '    # a comment\n    x = (1,\n         2)\n\n    def f(self):\n        "doc"\n'
                    '        return """not a docstring"""\n')
    assert code_stats.file_code_lines(str(path)) == 6
