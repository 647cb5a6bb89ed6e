"""The old name of ``minivllm/learn/exercises/__main__.py``: ``python -m minivllm.exercises grade
NB.ipynb [...]`` runs its ``main``."""
import sys

from minivllm.learn.exercises.__main__ import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m minivllm.exercises"))
