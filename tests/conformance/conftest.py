"""The conformance suite: the real vLLM 0.32 (CPU build) beside minivllm on the same inputs.

How it runs (README.md in this folder has the longer version):
- vLLM lives in its own venv (``bash tests/conformance/setup_vllm.sh``; ``MINIVLLM_VLLM_VENV`` moves
  it). Without it every test here is skipped with one line naming that script; with ``CI=true`` a
  missing venv is a failure instead, so a broken install can never pass CI silently.
- The vLLM side of a case is a script in ``vllm_side/`` run in that venv as a subprocess
  (``vllm_side(script, payload)``): it reads the payload as JSON, writes one JSON result. Calls are
  cached for the session by (script, payload), so one script per engine configuration computes
  everything the cases need and its engine starts once.
- Engine-starting scripts take ``/tmp/minivllm-vllm.lock`` (one ~7 GB vLLM at a time per machine)
  and get a bounded timeout; on timeout the whole process group is killed by its id.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import tempfile
from pathlib import Path

import pytest
from conftest import one_intra_op_thread  # tests/conftest.py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VLLM_SIDE = HERE / "vllm_side"
SETUP = "bash tests/conformance/setup_vllm.sh"
VLLM_VERSION = "0.32.0"
LOCK_PATH = "/tmp/minivllm-vllm.lock"


def vllm_venv() -> Path:
    return Path(os.environ.get("MINIVLLM_VLLM_VENV") or ROOT / ".venv-vllm")


def venv_problem() -> str | None:
    """Why the vLLM venv cannot be used, or None. Ready means setup_vllm.sh finished (its marker)."""
    venv = vllm_venv()
    marker = venv / ".minivllm-vllm-ready"
    if not (venv / "bin" / "python").exists():
        return f"no vLLM venv at {venv}"
    if not marker.exists() or marker.read_text().split()[:1] != [VLLM_VERSION]:
        return f"the vLLM venv at {venv} is incomplete (no vLLM {VLLM_VERSION} ready marker)"
    return None


def _missing_message(problem: str) -> str:
    return f"conformance suite: {problem}; create it with `{SETUP}`"


def pytest_collection_modifyitems(config, items):
    """Without the vLLM venv (and not under CI): the whole suite becomes ONE skipped test (the
    first) and the others are deselected, so ``pytest -q`` prints one line naming the set-up."""
    problem = venv_problem()
    ours = [it for it in items if HERE in Path(str(it.path)).resolve().parents]
    if problem is None or not ours or os.environ.get("CI", "").lower() == "true":
        return
    ours[0].add_marker(pytest.mark.skip(reason=_missing_message(problem)))
    rest = set(map(id, ours[1:]))
    config.hook.pytest_deselected(items=ours[1:])
    items[:] = [it for it in items if id(it) not in rest]


@pytest.fixture(autouse=True, scope="session")
def _require_vllm_venv():
    """Under CI (``CI=true``) a missing vLLM venv fails every test here: a broken install must
    never pass as a skip."""
    problem = venv_problem()
    if problem is not None:
        pytest.fail(_missing_message(problem) + " (CI=true: a missing vLLM is a failure, not a "
                    "skip)", pytrace=False)


# Scripts whose engines run their EngineCore in the script's own process (vLLM's InprocClient):
# one starts in ~6 s instead of ~26 s on two cores. Same scheduler, worker and outputs. Not f (its
# call log pins the calls of the multi-process engine: in one process vLLM's busy loop makes other
# calls, e.g. no has_pending_push_work), not g (`vllm serve` as a user runs it).
IN_PROCESS_ENGINE = {"ai_float32.py", "b_ngram.py", "h_heads.py", "j_suffix.py", "k_kv_events.py"}


# Scripts that run while the test computes minivllm's side (``vllm_side.start``): vLLM's worker
# gets one core and minivllm one thread (``one_intra_op_thread``), so the two never share a core.
# Bound to both cores beside minivllm's two threads, each side's OpenMP threads wait on the
# other's: case a took 103 s that way here, against 33 s one after the other.
BESIDE_MINIVLLM = {"ai_float32.py", "f_pd.py"}


def vllm_env(in_process: bool = False, one_core: bool = False) -> dict:
    """The environment vLLM's CPU build needs on a small machine (minivllm.bench.vllm.vllm_env),
    with the shared helper module (never minivllm) on its path and the venv's bin first;
    ``one_core``: its worker's threads bound to this process's last CPU only."""
    from minivllm.bench.vllm import vllm_env as base_env
    env = base_env()
    env.update(PYTHONPATH=str(VLLM_SIDE), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PATH=f"{vllm_venv() / 'bin'}:{os.environ.get('PATH', '')}")
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if one_core and len(os.sched_getaffinity(0)) > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(max(os.sched_getaffinity(0)))
    return env


class _Lock:
    """``flock`` on LOCK_PATH, waiting at most ``timeout`` seconds. A blocking wait (bounded by
    SIGALRM) rather than polling: the kernel hands a released lock to a waiter already blocked
    in flock, so a poller would keep losing it to ``flock`` commands of other vLLM users."""

    def __init__(self, timeout: float) -> None:
        self.timeout, self.f = timeout, None

    def __enter__(self):
        import threading
        self.f = open(LOCK_PATH, "a")
        if threading.current_thread() is not threading.main_thread():
            fcntl.flock(self.f, fcntl.LOCK_EX)            # no alarm off the main thread
            return self

        def expired(*_):
            raise TimeoutError(f"{LOCK_PATH} held by another vLLM run for {self.timeout:.0f} s")
        previous = signal.signal(signal.SIGALRM, expired)
        signal.alarm(int(self.timeout))
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX)
        except BaseException:
            self.f.close()
            raise
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


# Seconds a vLLM-side script may run (engine start included). Generous: on CI's two idle cores an
# engine starts in ~30 s, but a busy machine can be ten times slower; a hang still ends.
DEFAULT_TIMEOUT = float(os.environ.get("MINIVLLM_CONFORMANCE_TIMEOUT", "900"))


def run_vllm_script(script: str, payload: dict, timeout: float = DEFAULT_TIMEOUT,
                    engine: bool = True) -> dict:
    """Run ``vllm_side/<script>`` in the vLLM venv with ``payload`` as its input; return its JSON.

    ``engine=True`` (the script starts a vLLM engine) serialises it with other vLLM runs on this
    machine. The script and every process it spawns (EngineCore, worker) run in their own process
    group, killed by its id on timeout or failure, so no engine outlives the test.
    """
    python = vllm_venv() / "bin" / "python"
    with tempfile.TemporaryDirectory(prefix="minivllm-conf-") as tmp:
        inp, out = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(inp, "w") as f:
            json.dump(payload, f)
        log = open(os.path.join(tmp, "log.txt"), "w+")
        lock = _Lock(timeout=1800.0) if engine else None
        if lock is not None:
            lock.__enter__()
        try:
            from minivllm.bench.vllm import run_in_group
            rc = run_in_group([str(python), str(VLLM_SIDE / script), inp, out],
                              vllm_env(in_process=script in IN_PROCESS_ENGINE,
                                       one_core=script in BESIDE_MINIVLLM), tmp,
                              log, timeout)
        finally:
            if lock is not None:
                lock.__exit__(None, None, None)
        log.seek(0)
        tail = log.read()[-4000:]
        log.close()
        if rc is None:
            raise TimeoutError(f"vllm_side/{script} ran past {timeout:.0f} s; its output:\n{tail}")
        if rc != 0 or not os.path.exists(out):
            raise RuntimeError(f"vllm_side/{script} exited with {rc}; its output:\n{tail}")
        with open(out) as f:
            return json.load(f)


_CACHE: dict = {}


@pytest.fixture(scope="session")
def vllm_side():
    """``vllm_side(script, payload, timeout=DEFAULT_TIMEOUT, engine=True) -> dict``, cached for the
    session by (script, payload): the cases of one configuration share one run, hence one engine
    start. ``vllm_side.start(...)``, with the same arguments, begins that run in a background
    thread and returns at once, so that a fixture computes minivllm's side meanwhile (on one
    core each: BESIDE_MINIVLLM); the later call waits for it."""
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(max_workers=1)

    def start(script: str, payload: dict, timeout: float = DEFAULT_TIMEOUT,
              engine: bool = True):
        key = (script, json.dumps(payload, sort_keys=True))
        if key not in _CACHE:
            _CACHE[key] = pool.submit(run_vllm_script, script, payload, timeout, engine)
        return _CACHE[key]

    def call(script: str, payload: dict, timeout: float = DEFAULT_TIMEOUT,
             engine: bool = True) -> dict:
        return start(script, payload, timeout, engine).result()

    call.start = start
    yield call
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def conformance_model() -> str:
    """minivllm's converted SmolLM2-135M-Instruct directory (float32 safetensors, tokenizer, chat
    template): the ``model=`` of both engines."""
    from minivllm.model_executor.model_loader import DEFAULT_MODEL, resolve_model_path
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def chat_prompts(conformance_model) -> list[list[int]]:
    """8 chat prompts (4 that copy their input, 4 open; ``bench spec``'s), tokenised once with
    the model's chat template, given to both engines as token ids."""
    from minivllm.bench.spec import GROUNDED, OPEN
    from minivllm.model_executor.model_loader import load_tokenizer
    tok = load_tokenizer(conformance_model)
    texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                     add_generation_prompt=True) for t in GROUNDED[:4] + OPEN[:4]]
    # The template already holds the special tokens; add none (as minivllm's and vLLM's chat do).
    return [tok.encode(t, add_special_tokens=False) for t in texts]


# Plain greedy decoding's length in cases a and b: 64 tokens plus the 5 a k=5 step can look past
# max_tokens, so case b can replay each engine's drafts and acceptances from these outputs.
PLAIN_MAX_TOKENS = 69


# Case i's job (test_i_sampling.py): 4 of the chat prompts, 16 tokens, one case per sampling field.
SAMPLING_MAX_TOKENS = 16


@pytest.fixture(scope="session")
def sampling_job(conformance_model, chat_prompts) -> dict:
    """``{"prompts", "max_tokens", "cases": [{"name", "params"}]}``: case i's runs, the same in both
    engines (``logit_bias`` keys are strings, as JSON carries them)."""
    from minivllm.model_executor.model_loader import load_tokenizer
    the = load_tokenizer(conformance_model).encode(" the", add_special_tokens=False)[0]
    cases = [{"name": "plain", "params": {}},
             {"name": "presence", "params": {"presence_penalty": 1.5}},
             {"name": "frequency", "params": {"frequency_penalty": 1.0}},
             {"name": "repetition", "params": {"repetition_penalty": 1.3}},
             {"name": "logit_bias", "params": {"logit_bias": {str(the): 4.0}}},
             {"name": "bad_words", "params": {"bad_words": ["the", "The", " a"]}}]
    return {"prompts": chat_prompts[:2] + chat_prompts[4:6], "max_tokens": SAMPLING_MAX_TOKENS,
            "cases": cases}


@pytest.fixture(scope="session")
def vllm_float32_job(conformance_model, chat_prompts, sampling_job) -> tuple[str, dict]:
    """``(script, payload)`` of vLLM's side of cases a and i: one plain float32 engine
    (``vllm_side/ai_float32.py``)."""
    return "ai_float32.py", {"model": conformance_model, "sampling": sampling_job,
                             "greedy": {"prompts": chat_prompts, "max_tokens": PLAIN_MAX_TOKENS}}


@pytest.fixture(scope="session")
def vllm_float32(vllm_side, vllm_float32_job) -> dict:
    """``{"greedy": {"outputs", "top2"}, "sampling": {case name: ...}}`` from that engine."""
    return vllm_side(*vllm_float32_job)


@pytest.fixture(scope="session")
def plain_greedy(vllm_side, vllm_float32_job, conformance_model, chat_prompts) -> dict:
    """``{"minivllm": [[ids]], "vllm": [[ids]], "vllm_top2": ..., "max_tokens"}``: plain greedy float32 outputs
    of ``chat_prompts`` (``PLAIN_MAX_TOKENS``, ``ignore_eos``, one batch) in each engine; vLLM's
    from ``vllm_side/a_greedy.py`` (``vllm_float32``), with its top-2 logprobs per position."""
    from minivllm import LLM, SamplingParams
    vllm_side.start(*vllm_float32_job)   # runs while minivllm generates
    with one_intra_op_thread():
        llm = LLM(model=conformance_model, dtype="float32")
        params = SamplingParams(temperature=0.0, max_tokens=PLAIN_MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params,
                            use_tqdm=False)
        del llm
    theirs = vllm_side(*vllm_float32_job)["greedy"]
    return {"minivllm": [list(o.outputs[0].token_ids) for o in outs],
            "vllm": theirs["outputs"], "vllm_top2": theirs["top2"],
            "max_tokens": PLAIN_MAX_TOKENS}
