"""Classroom exercises: the checks the course's test cells call, their isolated grading, and
self-study.

- ``registry.py``: ``@exercise`` declares a check (its exercise, assignment, article step, the
  package implementations a solution may not call, the mistakes its hidden cases catch);
  ``EXERCISES`` holds them all;
- ``spec.py``, ``suffix.py``: assignment ``spec_decode`` (notebook 04); ``pd.py``: notebook 07;
- ``isolate.py``: ``IsolatedChecks``, the autograde preprocessor that runs each test cell's checks
  again in a fresh process, on the student's definitions only (notebooks/course/nbgrader_config.py);
- ``course.py``: the course folder (source notebooks, reference solutions, the release);
- ``grade.py``: ``minivllm grade NB.ipynb [...]``, self-study by nbgrader's validator.

``CHECKS`` maps the name an exercise cell defines to its check (the registry's, and notebook 07's).
"""
from minivllm.learn.exercises.pd import (InMemoryConnector, InMemoryConnectorMetadata,
                                         check_decode_load_plan, check_kv_connector,
                                         reference_decode_load_plan)
from minivllm.learn.exercises.registry import EXERCISES, Exercise, exercise
from minivllm.learn.exercises.spec import (ExerciseCheckError, _residual_reference_frequencies,
                                           check_num_blocks_to_allocate, check_propose_last_match,
                                           check_residual_distribution,
                                           check_spec_decode_logits_indices,
                                           reference_spec_decode_logits_indices)
from minivllm.learn.exercises.suffix import check_walk_suffix_tree

CHECKS = {
    "residual_distribution": check_residual_distribution,
    "propose_last_match": check_propose_last_match,
    "num_blocks_to_allocate": check_num_blocks_to_allocate,
    "spec_decode_logits_indices": check_spec_decode_logits_indices,
    "decode_load_plan": check_decode_load_plan,
    "MyKVConnector": check_kv_connector,
    "walk_suffix_tree": check_walk_suffix_tree,
}

__all__ = ["CHECKS", "EXERCISES", "Exercise", "ExerciseCheckError", "exercise",
           "InMemoryConnector", "InMemoryConnectorMetadata",
           "check_decode_load_plan", "check_kv_connector", "check_num_blocks_to_allocate",
           "check_propose_last_match", "check_residual_distribution",
           "check_spec_decode_logits_indices", "check_walk_suffix_tree",
           "reference_decode_load_plan", "reference_spec_decode_logits_indices",
           "_residual_reference_frequencies"]
