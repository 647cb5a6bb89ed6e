"""The course's source notebooks (nbgrader's layout, ``notebooks/course/source/<assignment>/``) as
data: ``solutions(assignment)`` gives each exercise's reference solution, the source of its
solution cell, keyed by the cell's ``grade_id`` (the name the cell defines).

The source notebooks are the solutions: there is no other copy. Tests and the course's cycle take
the reference solutions from here.
"""
from __future__ import annotations

import json
import os

COURSE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "notebooks", "course")

MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")


def solutions(assignment: str) -> dict[str, str]:
    """``{grade_id: source}`` for every solution cell of the assignment's source notebooks, in
    notebook order; the source as a student would write it (nbgrader's solution markers left
    out)."""
    folder = os.path.join(COURSE_DIR, "source", assignment)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no source notebooks for assignment {assignment!r} in {folder}")
    found: dict[str, str] = {}
    for notebook in sorted(n for n in os.listdir(folder) if n.endswith(".ipynb")):
        with open(os.path.join(folder, notebook), encoding="utf-8") as f:
            cells = json.load(f)["cells"]
        for cell in cells:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if cell["cell_type"] == "code" and meta.get("solution"):
                source = "".join(cell["source"]) if isinstance(cell["source"], list) \
                    else cell["source"]
                lines = [ln for ln in source.splitlines() if ln.strip() not in MARKERS]
                found[meta["grade_id"]] = "\n".join(lines) + "\n"
    return found
