"""Answers to the assignments ``pd`` and ``pd_at_scale`` for the course's cycle test: per exercise,
the solution cell with one common mistake (the reference solution is the source notebook's own
cell, read by ``minivllm.learn.exercises.course.solutions``) and the hint the check shows for it.

``MISTAKES`` holds every mistake the hidden cases catch (each exercise's ``mistakes=``), as edits
of the reference cell: ``(exercise, what the mistake is, [(old text, new text), ...], passes the
visible cases?, hint)``. ``ANSWERS`` takes one of them per exercise, in the contract's form.
"""
from __future__ import annotations

from minivllm.learn.exercises.course import solutions

MISTAKES = [
    # --- pd
    ('decode_load_plan', "the last prompt token's block stored when the prompt fills whole blocks",
     [('stored = (num_prompt_tokens - 1) // block_size * block_size',
       'stored = num_prompt_tokens // block_size * block_size')],
     True, 'the last prompt token is always recomputed'),
    ('decode_load_plan', 'the local prefix-cache hits loaded again',
     [('load = list(range(num_local_hit_tokens, stored))',
       'load = list(range(0, stored))')],
     True, 'tokens already in the local prefix cache are not loaded again'),
    ('MyKVConnector', 'kv_both decided by is_producer',
     [('if not self.is_consumer or len(prefix)',
       'if self.is_producer or len(prefix)')],
     True, 'Decide by is_consumer, not by is_producer'),
    ('MyKVConnector', 'the whole stored prefix returned, not only the tokens beyond the local hits',
     [('return len(prefix) - num_computed_tokens, False',
       'return len(prefix), False')],
     True, 'return only the tokens beyond the local hits'),
    ('MyWorkerConnector', "the request's blocks taken as contiguous",
     [('return torch.tensor(req.block_ids)[pos // block_size] * block_size + pos % block_size',
       'return req.block_ids[0] * block_size + pos')],
     True, 'block_ids[pos // block_size] * block_size + pos % block_size'),
    ('MyWorkerConnector', 'the store written in save_kv_layer, not deferred to wait_for_save',
     [('self.pending.setdefault(tuple(req.token_ids), {})[layer_name] = gathered',
       'self.store.setdefault(tuple(req.token_ids), {})[layer_name] = gathered')],
     True, 'publish them in wait_for_save'),
    ('MyWorkerConnector', 'the last, partial block saved (every block the request holds)',
     [('pos = torch.arange(len(req.token_ids))',
       'pos = torch.arange(len(req.block_ids) * block_size)')],
     True, "the request's last block is partial"),
    ('MyWorkerConnector', "rows stored before the layer's K/V is written (in start_load_kv)",
     [("""        for req in self._get_connector_metadata().requests:
            if not req.is_store:""",
       """        for req in self._get_connector_metadata().requests:
            if req.is_store:
                self.pending[tuple(req.token_ids)] = {
                    name: kv.view(2, -1, kv.shape[3] * kv.shape[4])[
                        :, slot_mapping(req, self.block_size)].clone()
                    for name, kv in self.kv_caches.items()}
            else:"""),
      ("""        rows = kv_layer.view(2, -1, kv_layer.shape[3] * kv_layer.shape[4])
        for req in self._get_connector_metadata().requests:
            if req.is_store:
                gathered = rows[:, slot_mapping(req, self.block_size)].cpu()   # a copy
                self.pending.setdefault(tuple(req.token_ids), {})[layer_name] = gathered""",
       """        pass   # gathered in start_load_kv""")],
     False, 'store a layer in its own save_kv_layer, from kv_layer'),
    # --- pd_at_scale
    ('block_hashes', 'the last, partial block hashed',
     [('for start in range(0, len(token_ids) - block_size + 1, block_size):',
       'for start in range(0, len(token_ids), block_size):')],
     True, 'the last block is partial'),
    ('block_hashes', 'the parent hash not chained',
     [('parent = hash_block_tokens(parent, token_ids',
       'parent = hash_block_tokens(None, token_ids')],
     False, "each block's hash is computed from its parent's"),
    ('block_hashes', 'a wrong seed for the first block',
     [('hashes, parent = [], None',
       'hashes, parent = [], b""')],
     False, 'the first block has no parent: pass None'),
    ('block_hashes', 'the cache salt in every block',
     [('if start == 0 and cache_salt else None',
       'if cache_salt else None')],
     True, 'the cache salt is an extra key of the first block only'),
    ('pick_replica', 'the overlap counted as every held block, not the prefix from the first',
     [("""        cached = 0
        for h in prompt_hashes:            # a prefix: stop at the first block it does not hold
            if h not in state["held"]:
                break
            cached += 1""",
       '        cached = len(set(prompt_hashes) & set(state["held"]))')],
     True, 'can use only a prefix'),
    ('pick_replica', "ties broken by the replicas' order",
     [("""key=lambda r: (scores[r], replicas[r]["num_ongoing"],
                                                 replicas[r]["blocks_in_use"]))""",
       'key=lambda r: scores[r])')],
     True, 'the scores tie: the fewest requests in flight wins'),
    ('pick_replica', 'overlap_score_weight applied to the load',
     [('weight * (len(prompt_hashes) - cached) + state["blocks_in_use"]',
       '(len(prompt_hashes) - cached) + weight * state["blocks_in_use"]')],
     True, 'the score is overlap_score_weight * (prompt blocks - prefix blocks held)'),
    ('needs_remote_prefill', 'remote at exactly pd_min_uncached_tokens left',
     [('uncached > pd_min_uncached_tokens',
       'uncached >= pd_min_uncached_tokens')],
     True, 'remote only when MORE than pd_min_uncached_tokens'),
    ('needs_remote_prefill', 'pd_min_uncached_tokens 0 not read as always remote',
     [('return pd_min_uncached_tokens <= 0 or uncached > pd_min_uncached_tokens',
       'return uncached > pd_min_uncached_tokens')],
     True, 'pd_min_uncached_tokens 0 means every request is prefilled remotely'),
    ('needs_remote_prefill', 'blocks compared with tokens',
     [('uncached = num_prompt_tokens - cached_blocks * block_size',
       'uncached = num_prompt_tokens // block_size - cached_blocks')],
     False, '(tokens, not blocks)'),
]

ASSIGNMENTS = ("pd", "pd_at_scale")


def reference_cells() -> dict[str, str]:
    """{exercise: its solution cell's source}, from the source notebooks."""
    return {name: src for a in ASSIGNMENTS for name, src in solutions(a).items()}


def mistaken(name: str, edits: list[tuple[str, str]]) -> str:
    """The reference cell of ``name`` with each ``old`` replaced by its ``new`` (each ``old`` must
    be there once)."""
    source = reference_cells()[name]
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"{name}: {old!r} is not once in the solution cell")
        source = source.replace(old, new)
    return source


# Per exercise, its first mistake that passes the visible cases: it costs exactly the exercise's
# points once the hidden cases run.
ANSWERS: dict[str, dict[str, str]] = {}
for _name, _, _edits, _visible_passes, _hint in MISTAKES:
    if _visible_passes and _name not in ANSWERS:
        ANSWERS[_name] = {"mistake": mistaken(_name, _edits), "hint": _hint}
