"""Classroom exercises: the checks the notebooks call, and a grader for a class's notebooks.

- ``registry.py``: ``@exercise``, the registry of every check (``EXERCISES``) and the guard against
  a solution that calls the package's own implementation of its step;
- ``spec.py``: the spec_decode assignment, notebook 04 (residual distribution, last-match n-gram,
  blocks to allocate, spec-decode logits indices);
- ``verify.py``: notebook 04's verify step (the accept/reject rule with the bonus token, what a
  rejection gives back, block verification);
- ``dynamic_k.py``: notebook 04's dynamic k;
- ``suffix.py``: notebook 04's suffix-tree walk;
- ``pd.py``: notebook 07 (which prompt tokens the decode instance loads and which it recomputes;
  the scheduler half of an in-memory KV connector);
- ``grade.py``: ``python -m minivllm.exercises grade NB.ipynb [...] [--csv FILE]`` runs each
  notebook's exercise cells in a fresh kernel and every check on them, with a time limit each.

``CHECKS`` maps the name an exercise cell defines to its check.
"""
from minivllm.learn.exercises.pd import (InMemoryConnector, InMemoryConnectorMetadata, check_decode_load_plan,
                                   check_kv_connector, reference_decode_load_plan)
from minivllm.learn.exercises.spec import (ExerciseCheckError, _residual_reference_frequencies,
                                     check_num_blocks_to_allocate, check_propose_last_match,
                                     check_residual_distribution, check_spec_decode_logits_indices,
                                     reference_spec_decode_logits_indices)
from minivllm.learn.exercises.dynamic_k import check_dynamic_k
from minivllm.learn.exercises.suffix import check_walk_suffix_tree
from minivllm.learn.exercises.verify import (check_accept_reject, check_block_verification,
                                             check_rejection_gives_back)

CHECKS = {
    "residual_distribution": check_residual_distribution,
    "propose_last_match": check_propose_last_match,
    "num_blocks_to_allocate": check_num_blocks_to_allocate,
    "spec_decode_logits_indices": check_spec_decode_logits_indices,
    "decode_load_plan": check_decode_load_plan,
    "MyKVConnector": check_kv_connector,
    "walk_suffix_tree": check_walk_suffix_tree,
    "accept_reject": check_accept_reject,
    "rejection_gives_back": check_rejection_gives_back,
    "dynamic_k": check_dynamic_k,
    "block_verification": check_block_verification,
}

__all__ = ["CHECKS", "ExerciseCheckError", "InMemoryConnector", "InMemoryConnectorMetadata",
           "check_accept_reject", "check_block_verification", "check_dynamic_k",
           "check_rejection_gives_back",
           "check_decode_load_plan", "check_kv_connector", "check_num_blocks_to_allocate",
           "check_propose_last_match", "check_residual_distribution",
           "check_spec_decode_logits_indices", "check_walk_suffix_tree", "reference_decode_load_plan",
           "reference_spec_decode_logits_indices", "_residual_reference_frequencies"]
