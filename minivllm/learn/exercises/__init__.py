"""Classroom exercises: the checks the course's notebooks call (one per article step), in the
registry every grader reads.

- ``registry.py``: ``@exercise``, the registry of every check (``EXERCISES``) and the guard against
  a solution that calls the package's own implementation of its step;
- ``spec.py``: the spec_decode assignment, notebook 04 (residual distribution, last-match n-gram,
  blocks to allocate, spec-decode logits indices);
- ``verify.py``: notebook 04's verify step (the accept/reject rule with the bonus token, what a
  rejection gives back, block verification);
- ``dynamic_k.py``: notebook 04's dynamic k;
- ``suffix.py``: notebook 04's suffix-tree walk;
- ``pd.py``: notebook 07, assignment ``pd`` (which prompt tokens the decode instance loads and
  which it recomputes; the scheduler half and the worker half of an in-memory KV connector);
- ``scale.py``: notebook 09, assignment ``pd_at_scale`` (the prefix-cache block hashes, the
  router's score and pick, the decode-first P/D decision);
- ``isolate.py`` (with ``fresh.py``, the fresh process): ``IsolatedChecks``, the autograde
  preprocessor that runs each test cell's checks again outside the student's kernel, on the
  student's definitions only (notebooks/course/nbgrader_config.py);
- ``course.py``: the course folder (source notebooks, reference solutions, the release);
- ``grade.py``: ``minivllm grade NB.ipynb [...]``, self-study by nbgrader's validator.

``CHECKS`` maps the name an exercise cell defines to its check.
"""
from minivllm.learn.exercises.dynamic_k import check_dynamic_k
from minivllm.learn.exercises.pd import (STORE, InMemoryConnector, InMemoryConnectorBase,
                                         InMemoryConnectorMetadata, InMemoryReqMeta,
                                         InMemorySchedulerConnector, check_decode_load_plan,
                                         check_MyKVConnector, check_MyWorkerConnector)
from minivllm.learn.exercises.registry import EXERCISES, Exercise, ExerciseCheckError, exercise
from minivllm.learn.exercises.scale import (check_block_hashes, check_needs_remote_prefill,
                                            check_pick_replica)
from minivllm.learn.exercises.spec import (_residual_reference_frequencies,
                                           check_num_blocks_to_allocate, check_propose_last_match,
                                           check_residual_distribution,
                                           check_spec_decode_logits_indices,
                                           reference_spec_decode_logits_indices)
from minivllm.learn.exercises.suffix import check_walk_suffix_tree
from minivllm.learn.exercises.verify import (check_accept_reject, check_block_verification,
                                             check_rejection_gives_back)

CHECKS = {name: ex.run for name, ex in EXERCISES.items()}

__all__ = ["CHECKS", "EXERCISES", "Exercise", "ExerciseCheckError", "exercise", "InMemoryConnector",
           "InMemoryConnectorBase", "InMemoryConnectorMetadata", "InMemoryReqMeta",
           "InMemorySchedulerConnector", "STORE", "check_MyKVConnector", "check_MyWorkerConnector",
           "check_accept_reject", "check_block_hashes", "check_block_verification",
           "check_decode_load_plan", "check_dynamic_k", "check_needs_remote_prefill",
           "check_num_blocks_to_allocate", "check_pick_replica", "check_propose_last_match",
           "check_rejection_gives_back", "check_residual_distribution",
           "check_spec_decode_logits_indices", "check_walk_suffix_tree",
           "reference_spec_decode_logits_indices", "_residual_reference_frequencies"]
