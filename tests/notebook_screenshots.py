"""The README's notebook screenshots, rendered by the browser test's harness (tests/nb_browser.py).

    python tests/notebook_screenshots.py            # writes figures/notebook01_slider.png, ..02..

Each notebook runs in JupyterLab in headless Chromium (MINIVLLM_NOTEBOOK_FAST=1); the first slider
is moved with the keyboard to a step worth showing, and the slider's widget box (slider, label and
the figure it redraws) is saved as a PNG. Needs /usr/bin/chromium and playwright, like the test.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nb_browser import REPO, lab_page  # noqa: E402
from nb_page import close_notebook, open_and_run  # noqa: E402

# (notebook, right-arrow presses on its first slider, on its second slider, output file)
SHOTS = [
    # Engine step 10: request 4 is preempted, its blocks back in the free queue; hatched blocks are
    # the 16-token instruction shared through the prefix cache.
    ("01_paged_kv_cache.ipynb", 10, 0, "notebook01_slider.png"),
    # The second verify step, position 2: the draft the target rejected and the uniform draw behind
    # the decision.
    ("02_speculative_decoding.ipynb", 1, 2, "notebook02_slider.png"),
]

_SLIDER_JS = """(i) => {
  const s = document.querySelectorAll('.jp-Notebook .widget-slider')[i];
  const box = document.querySelector('.jp-Notebook .widget-vbox');
  const img = [...(box ? box.querySelectorAll('.jp-OutputArea-output img') : [])].map(e => e.src);
  return {readout: s.querySelector('.widget-readout').textContent, img: img.join()};
}"""


def slide_to(page, which: int, presses: int, timeout: float = 120.0) -> dict:
    """Press the right arrow ``presses`` times on slider number ``which`` (0 = the first); return once
    its readout says ``presses`` and the figure has not changed for two seconds."""
    handle = page.locator(".jp-Notebook .widget-slider .noUi-handle").nth(which)
    handle.scroll_into_view_if_needed()
    handle.focus()
    for _ in range(presses):
        handle.press("ArrowRight")
    deadline = time.monotonic() + timeout
    last, stable_since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = page.evaluate(_SLIDER_JS, which)
        if now != last:
            last, stable_since = now, time.monotonic()
        elif now["readout"].strip() == str(presses) and time.monotonic() - stable_since > 2.0:
            return now
        time.sleep(0.25)
    raise TimeoutError(f"slider {which} did not settle at {presses} "
                       f"(readout {last and last['readout']!r})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "figures"), help="folder for the PNGs")
    ap.add_argument("--only", default="", help="only the notebook whose name contains this")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="minivllm-shots-")
    with lab_page(work, height=1100) as (lab, page):
        for name, first, second, out in SHOTS:
            if args.only and args.only not in name:
                continue
            view = open_and_run(page, lab, name, timeout=420)
            errors = [e for c in view.cells for e in c.errors()]
            if errors:
                raise RuntimeError(f"{name}: {errors}")
            slide_to(page, 0, first)
            if second:
                slide_to(page, 1, second)
            box = page.locator(".jp-Notebook .widget-vbox:has(.widget-slider)").first
            box.scroll_into_view_if_needed()
            path = os.path.join(args.out, out)
            box.screenshot(path=path)
            print(f"{path}: {name}, sliders moved {first}, {second}, run in {view.seconds:.0f} s")
            close_notebook(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
