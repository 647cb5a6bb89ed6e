"""Article-step breakpoints (minivllm/steps.py): every id has its one hook line in the function the
registry names; ids are checked; a real pdb stops once per requested id; outputs do not change."""
import os
import re
import subprocess
import sys

import pytest

import minivllm
from minivllm import SamplingParams, steps

from conftest import generate_tokens, tiny_llm

pytestmark = pytest.mark.usefixtures("one_thread", "disarmed_after")
PKG = os.path.dirname(minivllm.__file__)
NGRAM = {"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 3, "num_speculative_tokens": 3}
PROMPTS = [[5, 6, 7, 8, 9] * 3, [11, 12, 13, 14, 15]]


@pytest.fixture
def disarmed_after(monkeypatch):
    """A test disarms what it arms: the ids it asks for are its own (not named at this process's
    exit) and every function has its code back after it."""
    monkeypatch.setattr(steps, "_asked", {})
    monkeypatch.setattr(steps, "_seen", set())
    yield
    steps.disarm()


def test_every_step_stops_in_its_documented_function_and_the_files_carry_no_hook():
    for step in steps.STEPS:
        found = steps.sites(step.id)
        assert found[0][0].__qualname__.endswith(step.function.split(".")[-1]), step.id
        assert not found[0][0].__module__.endswith("__init__"), step.id   # the imported module
        for func, anchor in found:
            steps.anchor_of(func, anchor)          # exactly one statement starts with it
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py") and f not in ("steps.py", "tour.py"):
                text = open(os.path.join(dirpath, f)).read()
                assert "at_step(" not in text and "breakpoint()" not in text, f
    assert len(steps.REGISTRY) == len(steps.STEPS)
    for group in ("spec", "pd"):
        assert steps.GROUPS[group] and all(i.startswith(group + ".") for i in steps.GROUPS[group])


def test_armed_functions_get_their_code_back(tiny_llama_dir, monkeypatch):
    from minivllm.core.sched.scheduler import Scheduler
    original = Scheduler.schedule_running.__code__
    steps.configure(["spec.4"])
    assert Scheduler.schedule_running.__code__ is not original
    assert Scheduler.schedule_running.__code__.co_firstlineno == original.co_firstlineno
    steps.disarm()
    assert Scheduler.schedule_running.__code__ is original


def test_ids_are_checked_and_off_means_an_empty_dict(tiny_llama_dir, monkeypatch):
    with pytest.raises(ValueError, match="valid ids: spec.setup, spec.load, spec.1"):
        steps.parse("spec.4,spec.99")
    with pytest.raises(ValueError, match="pd.lookup"):
        tiny_llm(tiny_llama_dir, break_at=["nope"])
    assert steps.parse("pd.lookup, spec.4") == ("spec.4", "pd.lookup")   # registry order
    assert steps.parse("all") == tuple(steps.REGISTRY)
    monkeypatch.delenv("MINIVLLM_BREAK", raising=False)
    assert steps.configure() == () and steps.BREAKS == {}
    monkeypatch.setenv("MINIVLLM_BREAK", "spec")
    assert steps.configure() == steps.GROUPS["spec"]
    assert steps.configure([]) == () and not steps.BREAKS    # break_at wins over the environment


def test_outputs_identical_with_breakpoints_on_and_off(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("MINIVLLM_BREAK", raising=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, seed=3, ignore_eos=True)
    off = [generate_tokens(tiny_llm(tiny_llama_dir, NGRAM), PROMPTS, p) for p in (greedy, seeded)]
    seen = []
    monkeypatch.setattr(sys, "breakpointhook", lambda *a, **k: seen.append(steps.current.id))
    monkeypatch.setattr(steps, "quiet", True)
    on = [generate_tokens(tiny_llm(tiny_llama_dir, NGRAM, break_at=["all"]), PROMPTS, p)
          for p in (greedy,)]
    on.append(generate_tokens(tiny_llm(tiny_llama_dir, NGRAM, break_at=["all"]), PROMPTS, seeded))
    assert on == off
    # Greedy on this model repeats itself: every spec step is reached, once per LLM.
    assert seen[:len(steps.GROUPS["spec"])] == list(steps.GROUPS["spec"])
    steps.disarm()


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from conftest import tiny_llm, generate_tokens
from minivllm import SamplingParams
llm = tiny_llm({model!r}, {spec!r})
print("OUT", generate_tokens(llm, {prompts!r}, SamplingParams(temperature=0.0, max_tokens=8)))
"""


def test_pdb_fed_c_stops_once_per_requested_id(tiny_llama_dir):
    env = {**os.environ, "MINIVLLM_BREAK": "spec.1,spec.4,spec.7", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONBREAKPOINT", None)      # the default: pdb.set_trace
    code = SCRIPT.format(tests=os.path.dirname(__file__), model=tiny_llama_dir, spec=NGRAM,
                         prompts=PROMPTS)
    proc = subprocess.run([sys.executable, "-c", code], input="c\n" * 20, capture_output=True,
                          text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("(Pdb)") == 3, proc.stdout[-2000:]
    for step_id in ("spec.1", "spec.4", "spec.7"):
        assert proc.stderr.count(f"minivllm step {step_id}:") == 1, proc.stderr[-2000:]
    # pdb stops in the engine's own frame, at the hook line's successor in that function: the
    # line each banner names.
    assert "scheduler.py" in proc.stdout and "rejection_sampler.py" in proc.stdout
    banners = re.findall(r"minivllm step \S+: .* \[(\S+\.py):(\d+) ", proc.stderr)
    pdb_at = re.findall(r"> (\S+\.py)\((\d+)\)", proc.stdout)
    assert banners == pdb_at and len(banners) == 3, (banners, pdb_at)
    assert "OUT [[" in proc.stdout


def test_a_requested_step_that_never_stops_is_named_at_exit_with_why(tiny_llama_dir):
    env = {**os.environ, "MINIVLLM_BREAK": "spec.4,pd.lookup", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONBREAKPOINT", None)
    plain = SCRIPT.format(tests=os.path.dirname(__file__), model=tiny_llama_dir, spec=NGRAM,
                          prompts=[[11, 12, 13, 14, 15]]).replace("max_tokens=8", "max_tokens=2")
    proc = subprocess.run([sys.executable, "-c", plain], input="c\n" * 5, capture_output=True,
                          text=True, timeout=180, env=env)
    assert proc.returncode == 0 and "(Pdb)" not in proc.stdout, proc.stderr[-2000:]
    assert ("the requested step spec.4 never stopped: no request had drafts" in proc.stderr
            and "the requested step pd.lookup never stopped: the engine has no kv_transfer_config"
            in proc.stderr), proc.stderr[-2000:]
    # A prompt that repeats itself gets drafts: spec.4 stops, and only pd.lookup is named.
    repeats = SCRIPT.format(tests=os.path.dirname(__file__), model=tiny_llama_dir, spec=NGRAM,
                            prompts=[[5, 6, 7, 8, 9] * 3])
    proc = subprocess.run([sys.executable, "-c", repeats], input="c\n" * 5, capture_output=True,
                          text=True, timeout=180, env=env)
    assert proc.stdout.count("(Pdb)") == 1 and "spec.4 never" not in proc.stderr, proc.stderr[-2000:]
    assert "pd.lookup never stopped" in proc.stderr


def test_never_fired_names_the_missing_configuration(monkeypatch):
    monkeypatch.setattr(steps, "_asked", {"spec.7": None, "pd.async_ready": None})
    monkeypatch.setattr(steps, "_seen", {"spec.setup", "pd.init.scheduler"})
    assert steps.never_fired() == [
        "minivllm: the requested step spec.7 never stopped: no request had drafts (n-gram drafts "
        "need a prompt that repeats itself).",
        "minivllm: the requested step pd.async_ready never stopped: no load was asynchronous "
        "(SharedStorageConnector loads in the forward)."]
    monkeypatch.setattr(steps, "_seen", set())
    assert steps.never_fired()[0].endswith("spec.7 never stopped: the engine has no speculative_config.")


MODULE = '''class Host:
    def method(self, values):
        text = """a string
at column 0, inside a method"""
        total = len(text)
        ratio = values["num"] / values["den"]
        return total, ratio
'''


def _host(tmp_path, monkeypatch):
    """A module written to a file: a method holding a multi-line string at column 0."""
    import importlib
    (tmp_path / "stops_host.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("stops_host").Host


def test_a_method_with_a_column_0_string_arms_and_keeps_its_carets(tmp_path, monkeypatch):
    """Recompiled from the file's own syntax tree: a method whose string continues at column 0
    arms, the stop runs on the anchor's line, and a traceback's carets stay under the expression
    that failed (as in the original code)."""
    import traceback
    host = _host(tmp_path, monkeypatch)
    step = steps.Step("test.stop", "a test stop", "Host.method", "", "total", anchor="total = len(",
                      when="total > 0")
    original = host.method.__code__
    host.method.__code__ = steps._compile_stops(host.method, [(step, step.anchor)])
    try:
        assert host().method({"num": 1, "den": 2}) == (len("a string\nat column 0, inside a method"), 0.5)
        assert "test.stop" in steps._seen
        with pytest.raises(ZeroDivisionError) as armed:
            host().method({"num": 1, "den": 0})
    finally:
        host.method.__code__ = original
    with pytest.raises(ZeroDivisionError) as plain:
        host().method({"num": 1, "den": 0})
    def carets(exc):
        text = "".join(traceback.format_exception(exc.value))
        lines = text.splitlines()
        i = max(i for i, l in enumerate(lines) if "ratio = values" in l)
        return lines[i], lines[i + 1]
    assert carets(armed) == carets(plain)
    line, marks = carets(plain)
    # under the division, from its left operand on, not shifted left
    assert len(marks) - len(marks.lstrip()) == line.index('values["num"]') and "^" in marks


def test_the_banner_names_the_locals_and_says_why(monkeypatch, capsys):
    """A stop prints the step, the locals to look at (its show expressions) and the tour's "why"
    for it (the spec.4 note, from the frame's own locals)."""
    class Request:
        spec_token_ids, num_tokens_with_spec, num_computed_tokens = [7, 8], 12, 9
    class Sched:
        num_lookahead_tokens = 0
    def schedule_running(self, request, num_new_tokens):
        return steps.at_step("spec.4", True)
    monkeypatch.setattr(steps, "BREAKS", {"spec.4": True})
    monkeypatch.setattr(steps, "quiet", False)
    assert schedule_running(Sched(), Request(), 3)
    err = capsys.readouterr().err
    assert "minivllm step spec.4:" in err
    assert "look at: request.request_id, request.spec_token_ids, num_new_tokens" in err
    assert "why: num_new_tokens 3 = 1 sampled token" in err
    assert not steps.at_step("spec.4", True)        # each id stops once


@pytest.mark.parametrize("method,rule", [
    ("standard", "the article's token-wise rule"),
    ("block", "block verification (rejection_sample_method='block')")])
def test_the_spec7_note_names_the_rule_that_ran(tiny_llama_dir, monkeypatch, capsys, method, rule):
    """The spec.7 stop says which rule verified the drafts: the sampler's backend, read from the
    frame of ``RejectionSampler.forward``."""
    monkeypatch.delenv("MINIVLLM_BREAK", raising=False)
    monkeypatch.delenv("MINIVLLM_REJECTION_SAMPLER", raising=False)
    monkeypatch.setattr(sys, "breakpointhook", lambda *a, **k: None)
    monkeypatch.setattr(steps, "quiet", False)
    llm = tiny_llm(tiny_llama_dir, dict(NGRAM, rejection_sample_method=method), break_at=["spec.7"])
    generate_tokens(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    err = capsys.readouterr().err
    assert "minivllm step spec.7:" in err
    assert f"why: rule: {rule}" in err, err[-2000:]


def test_every_step_is_one_row():
    """Everything about a stop is in its Step row: anchor, condition, what it needs and why."""
    for step in steps.STEPS:
        assert step.anchor and step.when, step.id
        assert all(n in steps.REGISTRY and steps.REGISTRY[n].never_means for n in step.needs), step.id


def test_disarm_forgets_the_asked_ids(monkeypatch):
    """What a tour or a test armed and then disarmed is not named at exit."""
    monkeypatch.setenv("MINIVLLM_BREAK", "pd.async_wait")
    steps.configure()
    assert steps.never_fired() == [
        "minivllm: the requested step pd.async_wait never stopped: the engine has no "
        "kv_transfer_config."]
    steps.disarm()
    assert steps.never_fired() == [] and steps.BREAKS == {}


FLOW = '''import contextlib
class Host:
    def method(self, xs):
        total = 0
        for x in xs:
            total += x
        with contextlib.nullcontext():
            total += 1
        try:
            total += 2
        finally:
            total += 3
        if total:
            total += 4

        return total

    def tail(self):
        done = True
'''
# id -> (function, anchor, inside, the anchor's successor pdb stops at: what it starts with)
FLOW_STOPS = {"test.next": ("method", "total = 0", False, "for x in xs:"),
              "test.loop": ("method", "total += x", False, "for x in xs:"),
              "test.with": ("method", "total += 1", False, "with contextlib"),
              "test.try": ("method", "total += 2", False, "total += 3"),
              "test.inside": ("method", "if total:", True, "total += 4"),
              "test.if": ("method", "total += 4", False, "return total"),
              "test.return": ("tail", "done = True", False, "done = True")}


def test_the_banner_names_the_line_pdb_stops_at(tmp_path, monkeypatch, capsys):
    """A stop runs on its anchor's line, and pdb (the default ``breakpoint()``) stops at the next
    line event in that frame: the next statement, a loop's head at the end of its body, a ``with``
    line at the end of its block, a ``finally``, the statement after an ``if``, the return at the
    function's end. The banner's ``file:line`` (``steps.debugger_line``) is that line."""
    import importlib
    import io
    import pdb
    from minivllm import step_table
    (tmp_path / "flow_host.py").write_text(FLOW)
    monkeypatch.syspath_prepend(str(tmp_path))
    host = importlib.import_module("flow_host").Host
    lines = FLOW.splitlines()
    by_function = {}
    for step_id, (function, anchor, inside, _) in FLOW_STOPS.items():
        step = steps.Step(step_id, "a test stop", f"Host.{function}", "", "0", anchor=anchor,
                          inside=inside)
        monkeypatch.setitem(step_table.REGISTRY, step_id, step)
        by_function.setdefault(function, []).append((step, anchor))
    monkeypatch.setattr(steps, "BREAKS", dict.fromkeys(FLOW_STOPS, True))
    monkeypatch.setattr(steps, "quiet", False)
    pdb_out = {}

    def hook(*args, **kwargs):       # what PYTHONBREAKPOINT's default does, fed "c"
        pdb_out[steps.current.id] = out = io.StringIO()
        pdb.Pdb(stdin=io.StringIO("c\n"), stdout=out, readrc=False).set_trace(sys._getframe(1))

    monkeypatch.setattr(sys, "breakpointhook", hook)
    originals = {f: getattr(host, f).__code__ for f in by_function}
    try:
        for function, stops in by_function.items():
            getattr(host, function).__code__ = steps._compile_stops(getattr(host, function), stops)
        assert host().method([1, 2]) == 13 and host().tail() is None
    finally:
        for function, code in originals.items():
            getattr(host, function).__code__ = code
    banners = dict(re.findall(r"minivllm step (\S+): .*flow_host\.py:(\d+) ",
                              capsys.readouterr().err))
    for step_id, (_, _, _, successor) in FLOW_STOPS.items():
        stopped = int(re.search(r"flow_host\.py\((\d+)\)", pdb_out[step_id].getvalue()).group(1))
        assert lines[stopped - 1].strip().startswith(successor), (step_id, stopped)
        assert int(banners[step_id]) == stopped, (step_id, banners[step_id], stopped)
