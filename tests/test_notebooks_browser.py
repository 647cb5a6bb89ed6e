"""The notebooks with widgets, opened in JupyterLab in a real headless Chromium, as a student would.

nbclient (tests/test_notebooks.py) runs every cell but renders none; a widget exists only in a
browser. Here JupyterLab (127.0.0.1, random port and token, the project's "python3" kernel,
MINIVLLM_NOTEBOOK_FAST=1) runs all cells of each notebook with widgets while Chromium shows them
(tests/nb_browser.py), and the test asserts that
- every code cell executed and none has an error output;
- every widget output rendered as a live widget, never as its text fallback
  (``VBox(children=(IntSlider(...`` or "Error displaying widget");
- every cell's output, as the page shows it, fits a screen (the same limits as test_notebooks.py);
- the stored outputs agree with this run (nbval's rule, as test_notebooks.py compares the others);
- in notebooks 01 and 02, moving the first slider with the keyboard redraws the figure next to it.
A failing notebook leaves a screenshot (the path is in the failure message). JupyterLab, its
kernels and Chromium are stopped by PID when the module ends, also on failure.

Notebooks 03, 04 and 06 display no widget; they run under nbclient only (test_notebooks.py).

Missing chromium or playwright skips these tests on a developer's machine; under CI=true it fails.
"""
from __future__ import annotations

import os
import tempfile
import time

import pytest

from nb_browser import browser_missing, lab_page
from nb_page import close_notebook, move_first_slider, open_and_run, widget_problems
from test_notebooks import BROWSER_NOTEBOOKS, EXPECTED, MAX_CHARS, MAX_LINES, nbformat, read

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# BROWSER_NOTEBOOKS: the notebooks whose figures are widgets. 05 (the heaviest: it trains a Medusa
# head) shows only tqdm bars as widgets; it runs under nbclient alone to keep CI's budget.
SLIDER_NOTEBOOKS = {"01_paged_kv_cache.ipynb", "02_speculative_decoding.ipynb"}
RUN_TIMEOUT = 420          # seconds per notebook (05 trains a Medusa head)


@pytest.fixture(scope="module")
def browser():
    """(lab, page, screenshot dir): one JupyterLab and one Chromium for the whole module."""
    missing = browser_missing()
    if missing:
        if IN_CI:
            pytest.fail(f"browser notebook test cannot run under CI=true: {missing}")
        pytest.skip(f"browser notebook test: {missing}")
    work = tempfile.mkdtemp(prefix="minivllm-browser-")
    shots = os.environ.get("MINIVLLM_SCREENSHOT_DIR") or os.path.join(work, "screenshots")
    os.makedirs(shots, exist_ok=True)
    with lab_page(work, height=1000) as (lab, page):
        yield lab, page, shots


def _screenshot(page, shots: str, name: str, cell: int | None = None) -> str:
    path = os.path.join(shots, name.replace(".ipynb", "") + ".png")
    try:
        if cell is not None:
            page.evaluate("(i) => window.jupyterapp.shell.currentWidget.content.widgets[i]"
                          ".node.scrollIntoView()", cell)
        page.screenshot(path=path)
    except Exception as e:          # the page itself may be what failed
        return f"(no screenshot: {e})"
    return path


def _stale(view, name: str) -> list[str]:
    """Stored outputs that differ from the page's run (the rule test_notebooks.py applies to the
    notebooks it runs; this run is the one CI makes of these)."""
    import copy
    from minivllm.learn import notebooks as stored
    kept = read(name)
    fresh = copy.deepcopy(kept)
    for cell, seen in zip(fresh.cells, view.cells):
        if cell.cell_type == "code":
            cell.outputs = [nbformat.from_dict(o) for o in seen.outputs]
    return stored.stale_cells(kept, fresh, name)


def _problems(view, name: str) -> list[str]:
    """Cells that did not run, raised or do not fit a screen; lines of ``EXPECTED[name]`` the page
    does not show and stored outputs the run does not repeat (test_notebooks.py leaves these
    notebooks to this test when it runs); widgets shown as text."""
    shown = "\n".join(c.text for c in view.cells if c.cell_type == "code")
    out = [f"the page lacks {piece!r}" for piece in EXPECTED[name] if piece not in shown]
    out += _stale(view, name)
    for c in view.cells:
        if c.cell_type != "code":
            continue
        if c.execution_count is None:
            out.append(f"cell {c.index} did not run")
        out += [f"cell {c.index} raised {e}" for e in c.errors()]
        lines = c.text.count("\n") + 1 if c.text else 0
        if lines > MAX_LINES or len(c.text) > MAX_CHARS:
            out.append(f"cell {c.index} shows {lines} lines, {len(c.text):,} characters")
    return out + widget_problems(view)


def _first_cell(problems: list[str]) -> int | None:
    for p in problems:
        if p.startswith("cell "):
            return int(p.split()[1].rstrip(":"))
    return None


@pytest.mark.parametrize("name", BROWSER_NOTEBOOKS)
def test_notebook_in_the_browser(browser, name):
    lab, page, shots = browser
    try:
        view = open_and_run(page, lab, name, timeout=RUN_TIMEOUT)
        problems = _problems(view, name)
        if not problems and name in SLIDER_NOTEBOOKS:
            before, after = move_first_slider(page)
            if after["readout"] == before["readout"]:
                problems.append(f"the first slider did not move (readout {before['readout']!r})")
            elif after["img"] in ("", before["img"]):
                problems.append(f"moving the first slider from {before['readout']} to "
                                f"{after['readout']} did not redraw the figure next to it")
        if problems:
            shot = _screenshot(page, shots, name, _first_cell(problems))
            pytest.fail(f"{name} in JupyterLab ({view.seconds:.0f} s): " + "; ".join(problems)
                        + f"\nscreenshot: {shot}\nJupyterLab log:\n{lab.log_tail(15)}")
        print(f"{name}: ran in the browser in {view.seconds:.0f} s")
    except Exception as e:
        if isinstance(e, pytest.fail.Exception):
            raise
        shot = _screenshot(page, shots, name)
        raise AssertionError(f"{name}: {e}\nscreenshot: {shot}\nJupyterLab log:\n"
                             f"{lab.log_tail(15)}") from e
    finally:
        close_notebook(page)


WIDGET_PROBE = """import ipywidgets as widgets
widgets.IntSlider(value=3, description="probe")"""


def test_a_widget_without_the_widget_manager_is_reported(browser):
    """With @jupyter-widgets/jupyterlab-manager disabled, a slider shows as its text repr and the
    check above must say so (and with it enabled, the same cell passes)."""
    import nbformat
    lab, page, shots = browser
    probe = "widget_probe.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(WIDGET_PROBE)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, os.path.join(lab.workdir, "notebooks", probe))
    seen = {}
    try:
        for enabled in (True, False):
            lab.set_widget_manager(enabled)
            t0 = time.monotonic()
            view = open_and_run(page, lab, probe, timeout=120, settle=15.0 if enabled else 2.0)
            seen[enabled] = (widget_problems(view), time.monotonic() - t0)
            if enabled == bool(seen[enabled][0]):
                _screenshot(page, shots, f"widget_probe_{'on' if enabled else 'off'}")
            close_notebook(page)
    finally:
        lab.set_widget_manager(True)
    assert seen[True][0] == [], seen[True][0]
    assert len(seen[False][0]) == 1 and "IntSlider(value=3" in seen[False][0][0], seen[False][0]
