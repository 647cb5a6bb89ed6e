"""The old name of ``minivllm/learn/then_and_now.py`` (the article's function beside vLLM 0.32's
override): ``python -m minivllm.then_and_now [spec|pd]`` runs its ``main``; its names are
re-exported here."""
from minivllm.learn.then_and_now import THEN_AND_NOW, describe, diff, main, rows_for  # noqa: F401

if __name__ == "__main__":
    import sys
    sys.exit(main())
