"""The course folder (``notebooks/course/``, nbgrader's layout) as the package sees it: a learning
aid (vLLM has no counterpart) around the exercises of every article step.

- ``source_notebooks()``: the instructor's source notebooks, one folder per assignment;
- ``solutions(assignment)``: each exercise's reference solution, taken from its source notebook's
  solution cell (the markers ``### BEGIN SOLUTION`` / ``### END SOLUTION`` removed): the source
  notebooks are the solutions, nothing else holds them;
- ``release()``: ``python -m minivllm.learn.exercises release``: runs nbgrader's
  ``generate_assignment`` for every assignment in a temporary copy of the course folder and copies
  each ``release/<assignment>/<notebook>.ipynb`` to ``notebooks/<notebook>.ipynb``: the student
  notebooks are exactly what nbgrader writes;
- ``nbgrader(...)``: nbgrader's command line, run with this package importable (its kernels and
  the isolated checks import the same ``minivllm``).
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NOTEBOOKS_DIR = os.path.join(REPO, "notebooks")
COURSE_DIR = os.path.join(NOTEBOOKS_DIR, "course")
BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"


def source_notebooks(course_dir: str = COURSE_DIR) -> dict[str, list[str]]:
    """{assignment: [its source notebooks' paths]}, assignments and notebooks sorted by name."""
    found: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(course_dir, "source", "*", "*.ipynb"))):
        found.setdefault(os.path.basename(os.path.dirname(path)), []).append(path)
    return found


def grade_id(cell) -> Optional[str]:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def solution_source(source: str) -> str:
    """A solution cell's source without nbgrader's solution markers (the lines holding them)."""
    return "\n".join(line for line in source.split("\n")
                     if BEGIN_SOLUTION not in line and END_SOLUTION not in line)


def solutions(assignment: Optional[str] = None, course_dir: str = COURSE_DIR) -> dict[str, str]:
    """{exercise name (the solution cell's grade_id): the reference solution's source}, of one
    assignment or of all."""
    import nbformat
    sources = source_notebooks(course_dir)
    if assignment is not None and assignment not in sources:
        raise FileNotFoundError(f"no source notebook for assignment {assignment!r} in "
                                f"{os.path.join(course_dir, 'source')}")
    found = {}
    for name, paths in sources.items():
        if assignment is not None and name != assignment:
            continue
        for path in paths:
            for cell in nbformat.read(path, as_version=4).cells:
                meta = cell.metadata.get("nbgrader", {})
                if cell.cell_type == "code" and meta.get("solution") and not meta.get("grade"):
                    found[meta["grade_id"]] = solution_source(cell.source)
    return found


def nbgrader_env() -> dict[str, str]:
    """The environment nbgrader runs in: this package first on PYTHONPATH (kernels and the isolated
    checks import it), this interpreter's folder first on PATH (nbgrader calls ``alembic``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [REPO, env.get("PYTHONPATH")] if p)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def nbgrader(args: list[str], course_dir: str, check: bool = True) -> subprocess.CompletedProcess:
    """``nbgrader ARGS`` in ``course_dir`` (its nbgrader_config.py applies); output captured."""
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course_dir,
                          env=nbgrader_env(), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"nbgrader {' '.join(args)} failed ({done.returncode}):\n"
                           + done.stderr[-4000:])
    return done


def copy_course(course_dir: str, dest: str) -> str:
    """A fresh copy of the course: its config and source notebooks, none of nbgrader's state."""
    os.makedirs(dest, exist_ok=True)
    shutil.copy(os.path.join(course_dir, "nbgrader_config.py"), dest)
    shutil.copytree(os.path.join(course_dir, "source"), os.path.join(dest, "source"),
                    dirs_exist_ok=True)
    return dest


def release(course_dir: str = COURSE_DIR, out_dir: str = NOTEBOOKS_DIR) -> list[str]:
    """Write every assignment's student notebooks (nbgrader's release) to ``out_dir``; returns the
    paths written."""
    written = []
    with tempfile.TemporaryDirectory(prefix="minivllm-course-") as tmp:
        copy_course(course_dir, tmp)
        nbgrader(["generate_assignment", "*", "--force"], tmp)     # every assignment
        for assignment, paths in source_notebooks(course_dir).items():
            for path in paths:
                name = os.path.basename(path)
                target = os.path.join(out_dir, name)
                shutil.copyfile(os.path.join(tmp, "release", assignment, name), target)
                written.append(target)
    return written


def screenshot(html: str, png: str, width: int = 1100, height: int = 1500,
               chromium: Optional[str] = None) -> str:
    """A PNG of the top ``width`` x ``height`` pixels of an HTML page (a feedback page), by
    headless Chromium with a throwaway profile; the page's own anchor (``page.html#id``) scrolls."""
    chromium = (chromium or os.environ.get("MINIVLLM_CHROMIUM") or shutil.which("chromium")
                or shutil.which("chromium-browser"))
    if not chromium:
        raise RuntimeError("no chromium found (apt-get install chromium, or set MINIVLLM_CHROMIUM)")
    path, _, anchor = html.partition("#")
    url = "file://" + os.path.abspath(path) + (f"#{anchor}" if anchor else "")
    with tempfile.TemporaryDirectory(prefix="minivllm-chromium-") as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--hide-scrollbars", "--disable-background-networking",
                        f"--user-data-dir={profile}", f"--window-size={width},{height}",
                        "--virtual-time-budget=5000", f"--screenshot={os.path.abspath(png)}",
                        url], check=True, capture_output=True, timeout=120)
    try:                                      # a page of text: 64 colours are plenty, and small
        from PIL import Image
    except ImportError:
        return png
    with Image.open(png) as image:
        small = image.convert("RGB").quantize(colors=64)
    small.save(png, optimize=True)
    return png


def fill(nb, answers: dict[str, str]):
    """``nb`` (a released notebook) with each solution cell named in ``answers`` (by grade_id)
    replaced by that source, in place; returns ``nb``."""
    for cell in nb.cells:
        if grade_id(cell) in answers and cell.metadata["nbgrader"].get("solution"):
            cell.source = answers[grade_id(cell)]
    return nb


def solution_namespace(assignment: str, course_dir: str = COURSE_DIR) -> dict:
    """The reference solutions of ``assignment``, defined: its source notebooks' ``imports`` cells
    and solution cells run in order in one namespace, each cell compiled as a file of its own."""
    import nbformat
    ns: dict = {"__name__": f"solutions_{assignment}"}
    for path in source_notebooks(course_dir).get(assignment, []):
        for cell in nbformat.read(path, as_version=4).cells:
            meta = cell.metadata.get("nbgrader", {})
            if cell.cell_type == "code" and (meta.get("grade_id") == "imports" or (
                    meta.get("solution") and not meta.get("grade"))):
                name = f"<{os.path.basename(path)} {meta['grade_id']}>"
                exec(compile(solution_source(cell.source), name, "exec"), ns)
    return ns
