"""Case e's synthetic workload and its step loop, shared by both engines (plain Python, no imports
from either engine, so it runs unchanged in the vLLM venv and in minivllm's).

The loop plays the model runner: after each ``schedule()`` it makes up a ``ModelRunnerOutput``
(one sampled token for every request whose prefill is complete after this step, plus the drafts a
fixed acceptance pattern accepts), feeds it to ``update_from_output``, then injects the next drafts
through ``update_draft_token_ids``, the way the engine core does with ``take_draft_token_ids``.
An ``Adapter`` hides each engine's class names; the loop records, per step and per request, what
the conformance test compares.
"""
from __future__ import annotations

BLOCK_SIZE = 16
NUM_BLOCKS = 9                   # 8 usable (block 0 is the null block): forces two preemptions
MAX_NUM_BATCHED_TOKENS = 48      # chunked prefill under a small token budget
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 512
NUM_SPEC_TOKENS = 3
VOCAB = 1000                     # made-up token ids stay below this
MAX_STEPS = 200

_SHARED = [900 + (i * 7) % 97 for i in range(40)]   # a 40-token prefix (2 full blocks + 8)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % 800 + 1 for i in range(n)]


ARRIVAL_R5 = 1

# (request id, prompt token ids, max_tokens, arrival step). r1 and r3 share r0's first 40 tokens,
# r3 arrives after r0 finished its prefill, so it hits r0's cached blocks.
REQUESTS = [
    ("r0", _SHARED + _prompt(0, 30), 12, 0),
    ("r1", _SHARED + _prompt(1, 10), 10, 0),
    ("r2", _prompt(2, 20), 9, 0),
    ("r3", _SHARED + _prompt(3, 25), 8, 3),
    ("r4", _prompt(4, 60), 6, 5),
    # r0's first three blocks plus one token: a full prefix hit leaves one token to compute.
    ("r5", _SHARED + _prompt(0, 8) + [5], 4, ARRIVAL_R5),
]

# Accepted drafts at a request's j-th verification step: ACCEPT[j % len(ACCEPT)].
ACCEPT = [2, 0, 3, 1]


def sampled_token(req_id: str, position: int) -> int:
    """The made-up target model: the token a request samples at an output position."""
    return (sum(map(ord, req_id)) * 37 + position * 11) % VOCAB


def draft_tokens(req_id: str, num_tokens: int, num_accept: int) -> list[int]:
    """Drafts for positions num_tokens..+K: the first num_accept match what the target will sample."""
    out = []
    for i in range(NUM_SPEC_TOKENS):
        t = sampled_token(req_id, num_tokens + i)
        out.append(t if i < num_accept else (t + 1) % VOCAB)
    return out



class SchedulerAdapter:
    """What the workload reads from a scheduler, the same code for both engines: their
    ``SchedulerOutput`` and ``Request`` share these field names. A subclass sets ``self.s`` (the
    scheduler) and ``self.reqs`` (request id -> request) and adds ``add_request`` and
    ``runner_output`` (that engine's ModelRunnerOutput)."""

    def has_unfinished(self):
        return self.s.has_unfinished_requests()

    def schedule(self):
        return self.s.schedule()

    def describe(self, out) -> dict:
        new_blocks, hits = {}, {}
        for nr in out.scheduled_new_reqs:
            new_blocks[nr.req_id] = len(nr.block_ids[0])
            hits[nr.req_id] = nr.num_computed_tokens
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            ids = c.new_block_ids[i]
            new_blocks[rid] = len(ids[0]) if ids is not None else 0
            if rid in c.resumed_req_ids:
                hits[rid] = c.num_computed_tokens[i]
        return {"num_scheduled_tokens": dict(out.num_scheduled_tokens),
                "scheduled_spec_decode_tokens": {k: list(v) for k, v in
                                                 out.scheduled_spec_decode_tokens.items()},
                "new_blocks": new_blocks, "prefix_hit_tokens": hits,
                "new_req_ids": [nr.req_id for nr in out.scheduled_new_reqs],
                "resumed_req_ids": sorted(c.resumed_req_ids),
                "preempted_req_ids": sorted(out.preempted_req_ids or ()),
                "finished_req_ids": sorted(out.finished_req_ids)}

    def num_computed_tokens(self, rid):
        return self.reqs[rid].num_computed_tokens

    def num_tokens(self, rid):
        return self.reqs[rid].num_tokens

    def is_live(self, rid):
        return not self.reqs[rid].is_finished()

    def update_from_output(self, out, sampled):
        mro = self.runner_output(list(out.num_scheduled_tokens), sampled)
        before = {r for r, q in self.reqs.items() if q.is_finished()}
        self.s.update_from_output(out, mro)
        self._now = {r for r, q in self.reqs.items() if q.is_finished()} - before

    def finished_ids(self):
        return self._now

    def num_free_blocks(self):
        return self.s.kv_cache_manager.block_pool.get_num_free_blocks()


def run(adapter) -> list[dict]:
    """Drive ``adapter`` until every request finishes; return one record per step."""
    pending = list(REQUESTS)
    verifications: dict[str, int] = {}
    prompt_len = {rid: len(p) for rid, p, _, _ in REQUESTS}
    records = []
    for step in range(MAX_STEPS):
        for item in [r for r in pending if r[3] <= step]:
            adapter.add_request(item[0], item[1], item[2])
            pending.remove(item)
        if not pending and not adapter.has_unfinished():
            break
        out = adapter.schedule()
        rec = {"step": step, **adapter.describe(out)}
        sampled = {}
        for rid, n in rec["num_scheduled_tokens"].items():
            done, total = adapter.num_computed_tokens(rid), adapter.num_tokens(rid)
            if done < total:      # a prefill chunk that stops short: the runner discards its token
                sampled[rid] = []
                continue
            drafts = rec["scheduled_spec_decode_tokens"].get(rid, [])
            base = total - prompt_len[rid]   # output position the last token's logits predict
            good = 0                          # drafts accepted: the leading ones the target agrees with
            while good < len(drafts) and drafts[good] == sampled_token(rid, base + good):
                good += 1
            if drafts and min(drafts) >= 0:   # vLLM 0.32's -1 placeholders are no proposer's drafts
                verifications[rid] = verifications.get(rid, 0) + 1
            sampled[rid] = [sampled_token(rid, base + i) for i in range(good + 1)]
        adapter.update_from_output(out, sampled)
        rec["finished_now"] = sorted(adapter.finished_ids())
        rec["num_computed_tokens_after"] = {
            rid: adapter.num_computed_tokens(rid) for rid in rec["num_scheduled_tokens"]
            if adapter.is_live(rid)}
        rec["num_free_blocks"] = adapter.num_free_blocks()
        drafts_next = {}
        for rid, toks in sampled.items():
            if toks and adapter.is_live(rid):
                n_out = adapter.num_tokens(rid) - prompt_len[rid]
                j = verifications.get(rid, 0)
                drafts_next[rid] = draft_tokens(rid, n_out, ACCEPT[j % len(ACCEPT)])
        adapter.update_draft_token_ids(drafts_next)
        rec["drafts_injected"] = drafts_next
        records.append(rec)
    else:
        raise RuntimeError(f"workload did not finish in {MAX_STEPS} steps")
    return records
