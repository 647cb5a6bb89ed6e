"""A notebook in JupyterLab's page, read and driven as a student would (tests/nb_browser.py starts
the lab and the browser).

``open_and_run`` opens one notebook, runs all cells as the Run menu does, waits until the kernel is
idle, and returns what the page shows (``NotebookView``): per cell, the executed model's outputs and
how JupyterLab rendered each of them. It reads the app through ``window.jupyterapp``
(``--LabApp.expose_app_in_browser``). ``widget_problems`` lists widgets shown as text;
``move_first_slider`` presses a key on the first slider and waits for its figure to change.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from nb_browser import WIDGET_MIME, JupyterLab


@dataclass
class CellView:
    index: int
    cell_type: str
    execution_count: Optional[int]
    outputs: list[dict]                       # the notebook model's outputs (nbformat JSON)
    rendered: list[dict] = field(default_factory=list)   # per output area child: mime, text, widget
    text: str = ""                            # the rendered output area's text, as the page shows it

    def errors(self) -> list[str]:
        return [f"{o.get('ename')}: {o.get('evalue')}" for o in self.outputs
                if o.get("output_type") == "error"]

    def widget_outputs(self) -> int:
        return sum(WIDGET_MIME in o.get("data", {}) for o in self.outputs)


@dataclass
class NotebookView:
    name: str
    cells: list[CellView]
    seconds: float
    page_text: str


# Runs in the page: the current notebook panel of the exposed JupyterLab app.
_PANEL_JS = "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;" \
            " return w && w.content && w.sessionContext ? w : null; }"

_STATE_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  const prompts = [...w.node.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent);
  return {status: k ? k.status : 'none', busy: prompts.some(t => t.includes('*')),
          executed: w.content.widgets.filter(c => c.model.type === 'code' && c.model.executionCount !== null).length};
}"""

_CELLS_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  return w.content.widgets.map((c, i) => {
    const m = c.model, out = {index: i, cell_type: m.type, execution_count: null, outputs: [], rendered: [], text: ''};
    if (m.type !== 'code') return out;
    out.execution_count = m.executionCount;
    out.outputs = m.outputs.toJSON();
    const area = c.node.querySelector('.jp-Cell-outputArea');
    if (!area) return out;
    out.text = area.innerText;
    for (const child of area.querySelectorAll(':scope > .jp-OutputArea-child')) {
      const o = child.querySelector(':scope > .jp-OutputArea-output');
      if (!o) continue;
      const w = o.querySelector('.jupyter-widgets');
      // A widget view's node carries no data-mime-type; its renderer's class names it.
      const mime = o.getAttribute('data-mime-type') ||
        (w ? 'application/vnd.jupyter.widget-view+json' : 'none:' + o.className);
      out.rendered.push({mime, text: o.innerText.slice(0, 400),
                         widget: !!w && w.getBoundingClientRect().height > 0});
    }
    return out;
  });
}"""


def open_and_run(page, lab: JupyterLab, name: str, timeout: float = 240.0,
                 settle: float = 15.0) -> NotebookView:
    """Open ``name`` in ``page``, run all cells (the Run menu's command), wait for an idle kernel with
    no queued cell (or ``timeout``), and read back every cell as the page has it."""
    t0 = time.monotonic()
    # ?reset: a fresh workspace, so no notebook of an earlier page comes back (with its kernel).
    page.goto(lab.url(f"lab/tree/{name}?reset"), wait_until="domcontentloaded")
    page.wait_for_function(f"({_PANEL_JS})() !== null", timeout=120_000)
    page.evaluate("async () => { const w = window.jupyterapp.shell.currentWidget;"
                  " await w.context.ready; await w.sessionContext.ready; }")
    page.wait_for_function("() => { const k = window.jupyterapp.shell.currentWidget.sessionContext"
                           ".session?.kernel; return k && k.status === 'idle'; }", timeout=120_000)
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    deadline, idle_polls = t0 + timeout, 0
    while time.monotonic() < deadline:
        state = page.evaluate(_STATE_JS)
        # Idle twice in a row, one second apart, with nothing queued: done (or stopped at an error).
        idle_polls = idle_polls + 1 if state["status"] == "idle" and not state["busy"] \
            and state["executed"] else 0
        if idle_polls >= 2:
            break
        time.sleep(1.0)
    else:
        raise TimeoutError(f"{name}: the kernel was still busy after {timeout:.0f} s")
    # Widget views attach after the kernel is idle: read again (up to `settle` s) until all are live.
    settle = time.monotonic() + settle
    while True:
        cells = [CellView(**c) for c in page.evaluate(_CELLS_JS)]
        text = page.evaluate("() => window.jupyterapp.shell.currentWidget.node.innerText")
        view = NotebookView(name, cells, time.monotonic() - t0, text)
        if not widget_problems(view) or time.monotonic() > settle:
            return view
        time.sleep(0.5)


def close_notebook(page) -> None:
    """Shut down the current notebook's kernel and close its tab (the next notebook starts clean)."""
    page.evaluate("async () => { const w = window.jupyterapp.shell.currentWidget;"
                  " if (w && w.sessionContext) { await w.sessionContext.shutdown(); w.dispose(); } }")


def widget_problems(view: NotebookView) -> list[str]:
    """Every widget output that the page did not render as a live widget (text fallback,
    "Error displaying widget", an empty view)."""
    problems = []
    for c in view.cells:
        want = c.widget_outputs()
        live = sum(r["mime"] == WIDGET_MIME and r["widget"] for r in c.rendered)
        if want != live:
            shown = [f"{r['mime']}: {r['text'][:80]!r}" for r in c.rendered]
            problems.append(f"cell {c.index}: {want} widget output(s), {live} rendered as widgets; "
                            f"the page shows {shown}")
    if "Error displaying widget" in view.page_text:
        problems.append("the page says 'Error displaying widget'")
    return problems


def first_slider_figure(page) -> dict[str, str]:
    """The first slider on the page: its readout and the image of the figure in its widget box."""
    return page.evaluate("""() => {
      const s = document.querySelector('.jp-Notebook .widget-slider');
      if (!s) return null;
      const box = s.closest('.widget-vbox') || s.parentElement;
      const img = box.querySelector('.jp-OutputArea-output img');
      const readout = s.querySelector('.widget-readout');
      return {readout: readout ? readout.textContent : '', img: img ? img.src : ''};
    }""")


def move_first_slider(page, presses: int = 1, timeout: float = 90.0) -> tuple[dict, dict]:
    """Press the right arrow ``presses`` times on the first slider's handle (as a user would with the
    keyboard) and wait until the figure next to it is redrawn. Returns (before, after)."""
    before = first_slider_figure(page)
    if before is None:
        raise AssertionError("no slider on the page")
    handle = page.locator(".jp-Notebook .widget-slider .noUi-handle").first
    handle.scroll_into_view_if_needed()
    handle.focus()
    for _ in range(presses):
        handle.press("ArrowRight")
    deadline = time.monotonic() + timeout
    after = first_slider_figure(page)
    while time.monotonic() < deadline and (after["img"] in ("", before["img"])):
        time.sleep(0.5)
        after = first_slider_figure(page)
    return before, after
