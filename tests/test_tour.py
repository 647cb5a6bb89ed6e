"""python -m minivllm.tour spec|pd: stops in the article's order, at the documented functions, with
the live values printed (tiny model, few tokens)."""
import io
import os
import re
import subprocess
import sys

import pytest

from minivllm import steps
from minivllm.learn import tour

pytestmark = pytest.mark.usefixtures("one_thread")


def _check_stops(stops, expected_ids):
    assert [s.id for s in stops] == list(expected_ids)
    for s in stops:
        step = steps.REGISTRY[s.id]
        assert s.function == step.function, s
        assert s.file.endswith(os.path.join("minivllm", step.file)), s


def test_tour_spec_in_order_at_the_documented_functions(tiny_llama_dir):
    buf = io.StringIO()
    t = tour.run(["spec", "--model", tiny_llama_dir, "--no-wait", "--temperature", "0",
                  "--max-tokens", "8"], out=buf)
    _check_stops(t.stops, tour.TOURS["spec"])
    out = buf.getvalue()
    assert "<error" not in out, out
    for needle in ("request.spec_token_ids = [", "token_budget = ", "new_blocks.get_block_ids() = ",
                   "logits_indices = [", "p_target=", "tour done: 11 stops",
                   # the prompts, spec.4's sum and the lookahead, spec.6's rows with a prefill chunk
                   "prompts: the last one arrives once the first drafts exist", "1 sampled token whose KV "
                   "is not computed yet + ", "why: num_lookahead_tokens 0: extra slots",
                   "(prefill chunk: only its last row)", "(verify of ", "engine steps (one target "
                   "forward each", "verify steps: "):
        assert needle in out, needle
    spec6 = out.split("\nspec.6\n", 1)[1].split("\nspec.7\n", 1)[0]
    assert "prefill chunk" in spec6 and "verify of" in spec6, spec6
    # Every numbered step says why: spec.1 the rows the LM head reads, spec.8 the stop condition.
    spec1 = out.split("\nspec.1\n", 1)[1].split("\nspec.2\n", 1)[0]
    assert "why: req 0: rows 0..14 (15 tokens) -> logits rows [14] (a prefill samples one " \
        "token, from its last prompt row)" in spec1, spec1
    assert re.search(r"why: logits \(3, \d+\) = \(rows picked, vocabulary\): the LM head runs on "
                     r"3 of the 27 hidden states", spec1), spec1
    spec8 = out.split("\nspec.8\n", 1)[1].split("\ntour done", 1)[0]
    assert re.search(r"why: check_stop: .*, so FINISHED_", spec8), spec8
    assert "why: it runs after each token appended: this step gave the request " in spec8, spec8
    assert re.search(r"where: +minivllm/core/sched/scheduler.py:\d+ +in Scheduler.schedule", out)
    assert steps.BREAKS == {}                               # the tour disarms what it armed


def test_tour_cli_pdb_fed_c_stops_once_per_step(tiny_llama_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "minivllm.tour", "spec", "--model", tiny_llama_dir, "--pdb",
         "--temperature", "0", "--max-tokens", "8"], input="c\n" * 30,
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = [ln for ln in proc.stdout.splitlines() if ln in steps.REGISTRY]   # each id on its own line
    assert ids == list(tour.TOURS["spec"])
    assert proc.stdout.count("(Pdb)") == len(tour.TOURS["spec"]), proc.stdout[-3000:]
    assert "-> scheduled_running_reqs.append(request)" in proc.stdout   # pdb in the engine's frame
    # Each stop's "where:" is the line pdb then stops at (the next line to run), in the same file.
    where = re.findall(r"where: +(\S+\.py):(\d+) ", proc.stdout)
    pdb_at = re.findall(r"> (\S+\.py)\((\d+)\)", proc.stdout)
    assert len(where) == len(pdb_at) == len(tour.TOURS["spec"]), proc.stdout[-3000:]
    for (file, line), (pdb_file, pdb_line) in zip(where, pdb_at):
        assert pdb_file.endswith(file) and line == pdb_line, (file, line, pdb_file, pdb_line)


def test_tour_pd_in_order_with_a_real_transfer(tiny_llama_dir):
    buf = io.StringIO()
    t = tour.run(["pd", "--model", tiny_llama_dir, "--no-wait", "--max-tokens", "4"], out=buf)
    out = buf.getvalue()
    order = tour.TOURS["pd"]
    assert [s.instance for s in t.stops] == ["prefill"] * len(order) + ["decode"] * len(order)
    _check_stops(t.stops[:len(order)], order)
    _check_stops(t.stops[len(order):], order)
    assert "<error" not in out, out
    prefill, decode = out.split("(decode instance)", 1)
    # The 40-token prompt: P stores 32 tokens (two 16-token blocks), D finds them all.
    assert "num_external_computed_tokens = 0" in prefill
    assert "num_external_computed_tokens = 32" in decode
    assert "'is_store': True" in prefill and "'is_store': False" in decode
    assert re.search(r"/: \d+ files \(", prefill)          # pd.exit lists the files written
    # why 32 of 40, that the per-layer stops do nothing here, and whose files the decode exit lists
    assert "(n - 1) // 16 * 16 = 32 of 40 tokens" in out
    assert "why: _layerwise is False" in prefill and "why: _layerwise is False" in decode
    # pd.layer_save does what save_kv_layer's code does (and figures/pd_flow.png draws): a copy of
    # the layer's rows into host memory on every layer; the files come in wait_for_save.
    layer_save = prefill.split("\npd.layer_save\n", 1)[1].split("\npd.exit\n", 1)[0]
    assert "_layerwise" not in layer_save and "returns at once" not in layer_save, layer_save
    assert "gathers this layer's rows" in layer_save and "in wait_for_save" in layer_save
    # md.slot_mapping is the batch's (40 + 5 + 7 slots); the 40-token prompt stores 32 rows of
    # it, the 5- and 7-token prompts none.
    assert "tuple(md.slot_mapping.shape) = (52,)" in layer_save, layer_save
    assert "why: md.slot_mapping is the whole batch's: one paged-cache slot per token this step " \
        "computes, 52 = 40 + 5 + 7 (3 requests)" in layer_save, layer_save
    assert "stores (each request's own slot mapping): req 0 tokens [0, 32), 32 rows" in layer_save
    assert "the 5- and 7-token prompts, no longer than one block, store nothing" in layer_save
    decode_save = decode.split("\npd.layer_save\n", 1)[1].split("\npd.exit\n", 1)[0]
    assert "computes, 20 = 8 + 5 + 7 (3 requests)" in decode_save, decode_save
    assert "(pd.async_wait and pd.async_ready need an asynchronous load: python -m minivllm.tour " \
        "pd --connector redis)" in out
    assert "these files are the prefill instance's" in decode
    assert "prompts: the prefill instance computes them" in out


def test_tour_pd_over_redis_reaches_the_async_stops(tiny_llama_dir):
    """``--connector redis``: a redis-server the tour starts (and stops), the decode instance loads
    asynchronously, so it stops at pd.async_wait and pd.async_ready as well."""
    buf = io.StringIO()
    t = tour.run(["pd", "--model", tiny_llama_dir, "--no-wait", "--max-tokens", "4",
                  "--connector", "redis"], out=buf)
    out = buf.getvalue()
    assert "<error" not in out, out
    decode = [s.id for s in t.stops if s.instance == "decode"]
    assert set(decode) == set(tour.pd_stops("redis")), decode
    assert decode.index("pd.async_wait") < decode.index("pd.async_ready")
    assert not [s for s in t.stops if s.instance == "prefill" and s.id.startswith("pd.async")]
    assert "; connector redis" in out.splitlines()[0]
    assert "load_kv_async = True" in out.split("(decode instance)", 1)[1]


@pytest.mark.parametrize("method, lookahead", [("draft_model", 3), ("suffix", 0)])
def test_tour_spec_method_swaps_the_drafter(tiny_llama_dir, method, lookahead):
    """``--method``: every spec stop, with the drafter asked for; a draft model reserves k
    lookahead slots (spec.4) and its own forward is described at spec.2; suffix needs none."""
    buf = io.StringIO()
    t = tour.run(["spec", "--model", tiny_llama_dir, "--no-wait", "--temperature", "0",
                  "--max-tokens", "8", "--method", method], out=buf)
    _check_stops(t.stops, tour.TOURS["spec"])
    out = buf.getvalue()
    assert "<error" not in out, out
    assert f"why: num_lookahead_tokens {lookahead}: " in out
    spec2 = out.split("\nspec.2\n", 1)[1].split("\nspec.3\n", 1)[0]
    if method == "draft_model":
        assert "DraftModelProposer ran a forward of its own" in spec2, spec2
        assert "type(self.drafter).__name__ = 'DraftModelProposer'" in out
    else:
        assert "tree; draft scores [" in spec2, spec2


FAST_PATHS = ("minivllm.attention.backends.cpu_attn", "minivllm.model_executor.cpu_linear",
              "minivllm.model_executor.kernel_choice", "minivllm.model_executor.packed_weight",
              "minivllm.model_executor.route_cache")


def test_tour_plain_runs_the_reference_paths_only(tiny_llama_dir):
    """``--plain``: every stop is reached, and a debugger stepping into the forward finds plain
    torch: the reference attention, ``F.linear``; no fast-path module loads, and the route
    variable is given back afterwards."""
    code = ("import io, os, sys\nfrom minivllm.learn import tour\nbuf = io.StringIO()\n"
            f"t = tour.run(['pd', '--model', {tiny_llama_dir!r}, '--no-wait', '--max-tokens', '4',"
            " '--plain'], out=buf)\n"
            "print('STOPS', ' '.join(s.id for s in t.stops))\n"
            "print('HEAD', buf.getvalue().splitlines()[0])\n"
            "print('ROUTE', os.environ.get('MINIVLLM_LINEAR_ROUTE'))\n"
            "print('MODULES', ' '.join(sorted(m for m in sys.modules if m.startswith('minivllm.'))))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MINIVLLM_LINEAR_ROUTE", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines()
                 if ln.split(" ", 1)[0] in ("STOPS", "HEAD", "ROUTE", "MODULES"))
    assert lines["STOPS"].split() == list(tour.TOURS["pd"]) * 2
    assert lines["HEAD"].endswith("; reference paths")
    assert lines["ROUTE"] == "None"
    modules = lines["MODULES"].split()
    assert "minivllm.attention.backends.torch_ref" in modules
    assert not [m for m in FAST_PATHS if m in modules]


def test_tour_spec_plain_verifies_with_the_article_rule(tiny_llama_dir, monkeypatch):
    """``--plain``: the rejection sampler's "reference" backend (sample/rejection_reference.py) makes
    the random rows' decisions, spec.7 says so, and the environment is given back; spec.1.forward
    stops before the prefill's forward, in the same function as spec.1."""
    from minivllm.sample import rejection_reference
    calls = []
    rule = rejection_reference.accept_or_recover
    monkeypatch.setattr(rejection_reference, "accept_or_recover",
                        lambda *a, **k: calls.append(a[0]) or rule(*a, **k))
    monkeypatch.delenv("MINIVLLM_REJECTION_SAMPLER", raising=False)
    buf = io.StringIO()
    # Random rows (temperature > 0), near greedy, where the tiny model repeats itself: drafts come.
    t = tour.run(["spec", "--model", tiny_llama_dir, "--no-wait", "--max-tokens", "8", "--plain",
                  "--temperature", "0.05"], out=buf)
    _check_stops(t.stops, tour.TOURS["spec"])
    out = buf.getvalue()
    assert "self.backend = 'reference'" in out.split("\nspec.7\n", 1)[1]
    assert "rule: the article's token-wise rule" in out.split("\nspec.7\n", 1)[1]
    assert calls, "the random rows did not go through accept_or_recover"
    assert "MINIVLLM_REJECTION_SAMPLER" not in os.environ
    forward = out.split("\nspec.1.forward\n", 1)[1].split("\nspec.1\n", 1)[0]
    assert "input_ids = [" in forward and "ModelRunner.execute_model" in forward
