"""The learning aids around the article's engine (vLLM has none of these): they drive the engine
and read its records.

- ``tour.py``: ``python -m minivllm.tour spec|pd``, the article's runs stopping at each step (the
  stops themselves are the engine's: ``minivllm/steps.py``, ``minivllm/step_table.py``);
- ``then_and_now.py``: the article's function beside vLLM 0.32's override, as a diff;
- ``notebooks.py``: the lesson notebooks, stored executed, and the check that their outputs are true;
- ``viz/``: views of the step records (block tables, a verify step, P/D transfers) for the notebooks;
- ``exercises/``: the checks the exercise notebooks call, the course's isolated grading, and
  ``minivllm grade`` (self-study).
"""
