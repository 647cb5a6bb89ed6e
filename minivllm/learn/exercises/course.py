"""The nbgrader course in the repository, ``notebooks/course/`` (DESIGN 5.8), as the checks' tests
read it: the reference solutions are the solution cells of the source notebooks
(``source/<assignment>/*.ipynb``), not a copy of them.
"""
from __future__ import annotations

import glob
import os

from minivllm.learn.notebooks import NOTEBOOK_DIR

COURSE_DIR = os.path.join(NOTEBOOK_DIR, "course")


def solutions(assignment: str) -> dict[str, str]:
    """``{grade_id: cell source}`` of the solution cells (nbgrader metadata ``solution: true``)
    of every source notebook of ``assignment``, markers included (Python ignores them)."""
    import nbformat
    paths = sorted(glob.glob(os.path.join(COURSE_DIR, "source", assignment, "*.ipynb")))
    if not paths:
        raise FileNotFoundError(f"no source notebook for assignment {assignment!r} under "
                                f"{os.path.join(COURSE_DIR, 'source')}")
    out: dict[str, str] = {}
    for path in paths:
        for cell in nbformat.read(path, as_version=4).cells:
            nb = cell.metadata.get("nbgrader", {})
            if cell.cell_type == "code" and nb.get("solution"):
                out[nb["grade_id"]] = cell.source
    return out
