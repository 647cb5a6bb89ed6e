"""nbgrader's configuration for minivllm's course (run nbgrader from this folder).

The assignments: ``spec_decode`` (speculative decoding, notebook 04), ``pd`` (disaggregated
prefill/decode, notebook 07) and ``pd_at_scale`` (P/D at scale, notebook 09), one source notebook
each in ``source/<assignment>/``. nbgrader's own folders (``release/``, ``submitted/``,
``autograded/``, ``feedback/``) and ``gradebook.db`` are made here and kept out of git. The commands
and what each step shows a teacher: README.md beside this file.

Grading, beyond nbgrader's defaults:
- every cell has a time limit (``Execute.timeout``): a cell that runs past it is interrupted, scores
  0 if it is a test cell, and the rest of the notebook runs;
- a deleted test cell is added back from the gradebook and graded (``add_missing_cells``), as an
  edited locked cell is restored;
- ``IsolatedChecks`` runs right after ``Execute``: each test cell's checks run again outside the
  student's kernel, in a fresh Python process with its own time limit, on the student's
  definitions only, and that result is the cell's output nbgrader scores (a check patched from a
  student's cell changes nothing; see minivllm/learn/exercises/isolate.py);
- the feedback page leaves out the hidden tests' source (``ClearHiddenTests``); their results, with
  each failed case and its hint, stay.

A dead kernel (``os._exit`` in a cell, a segfault): nbgrader's ``Execute`` stops with
``DeadKernelError`` and autograde drops the whole submission. It logs "There was an error processing
assignment", deletes that student's ``autograded/<student>/<assignment>/``, grades the other
students and exits with status 1. The gradebook keeps the submission with every test cell at 0 and
flagged for manual grading (formgrader lists it as "needs manual grade"; ``nbgrader export`` writes
0), and ``generate_feedback`` makes no page for it. The teacher grades that notebook by hand, or
asks for a resubmission without the cell that kills the kernel.
"""
import os

c = get_config()  # noqa: F821 (nbgrader's config loader defines it)

c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))
c.CourseDirectory.course_id = "minivllm"
# The assignments are the folders of source/ (nbgrader's gradebook learns them at
# generate_assignment): spec_decode (speculative decoding, notebook 04), pd (disaggregated
# prefill/decode, notebook 07), pd_at_scale (P/D at scale, notebook 09).

# The stub generate_assignment writes in place of a solution (nbgrader's own): it raises
# NotImplementedError, which every check reports as "not written yet".
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}

# Seconds per cell in the student's kernel (autograde and validate); then the cell is interrupted.
c.Execute.timeout = 60

# A deleted test cell comes back from the gradebook and is graded.
c.OverwriteCells.add_missing_cells = True

# The checks again, outside the student's kernel, before nbgrader reads the scores.
c.Autograde.autograde_preprocessors = [
    "nbgrader.preprocessors.Execute",
    "minivllm.learn.exercises.isolate.IsolatedChecks",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]
c.IsolatedChecks.timeout = 60     # seconds per exercise in the fresh process

# The feedback page: the autograded notebook without the hidden tests' source.
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbgrader.preprocessors.ClearHiddenTests",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
]
