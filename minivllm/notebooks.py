"""The old name of ``minivllm/learn/notebooks.py`` (the lesson notebooks, stored executed):
``python -m minivllm.notebooks refresh|check [NB.ipynb ...]`` runs its ``main``; its names are
re-exported here."""
from minivllm.learn.notebooks import (CELL_TIMEOUT, EXERCISE_NOTEBOOKS, KERNEL_ENV,  # noqa: F401
                                      MAX_BYTES, NOTEBOOK_DIR, SANITIZE_FILE, check, execute,
                                      is_progress_bar, lesson_notebooks, main, read, refresh,
                                      sanitize_patterns, stale_cells, unexecuted_code_cells)

if __name__ == "__main__":
    import sys
    sys.exit(main())
