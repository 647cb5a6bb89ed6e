"""Classroom exercises: the checks the notebooks call, and a grader for a class's notebooks.

- ``spec.py``: notebook 04 (residual distribution, last-match n-gram, blocks to allocate,
  spec-decode logits indices);
- ``suffix.py``: notebook 04's exercise 5 (walk a suffix tree greedily by frequency);
- ``pd.py``: notebook 07, assignment ``pd`` (which prompt tokens the decode instance loads and
  which it recomputes; the scheduler half and the worker half of an in-memory KV connector);
- ``scale.py``: notebook 09, assignment ``pd_at_scale`` (the prefix-cache block hashes, the
  router's score and pick, the decode-first P/D decision);
- ``grade.py``: ``python -m minivllm.exercises grade NB.ipynb [...] [--csv FILE]`` runs each
  notebook's exercise cells in a fresh kernel and every check on them, with a time limit each.

``CHECKS`` maps the name an exercise cell defines to its check.
"""
from minivllm.learn.exercises.pd import (STORE, InMemoryConnector, InMemoryConnectorBase,
                                         InMemoryConnectorMetadata, InMemoryReqMeta,
                                         InMemorySchedulerConnector, check_decode_load_plan,
                                         check_MyKVConnector, check_MyWorkerConnector)
from minivllm.learn.exercises.registry import ExerciseCheckError
from minivllm.learn.exercises.scale import (check_block_hashes, check_needs_remote_prefill,
                                            check_pick_replica)
from minivllm.learn.exercises.spec import (_residual_reference_frequencies,
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
    "MyKVConnector": check_MyKVConnector,
    "MyWorkerConnector": check_MyWorkerConnector,
    "block_hashes": check_block_hashes,
    "pick_replica": check_pick_replica,
    "needs_remote_prefill": check_needs_remote_prefill,
    "walk_suffix_tree": check_walk_suffix_tree,
}

__all__ = ["CHECKS", "ExerciseCheckError", "InMemoryConnector", "InMemoryConnectorBase",
           "InMemoryConnectorMetadata", "InMemoryReqMeta", "InMemorySchedulerConnector", "STORE",
           "check_MyKVConnector", "check_MyWorkerConnector", "check_block_hashes",
           "check_needs_remote_prefill", "check_pick_replica",
           "check_decode_load_plan", "check_num_blocks_to_allocate",
           "check_propose_last_match", "check_residual_distribution",
           "check_spec_decode_logits_indices", "check_walk_suffix_tree",
           "reference_spec_decode_logits_indices", "_residual_reference_frequencies"]
