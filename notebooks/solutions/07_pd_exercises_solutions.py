"""Solutions to notebooks/07_pd_exercises.ipynb (kept apart from the student notebook).

Each definition has the exercise's exact signature; ``python notebooks/solutions/07_pd_exercises_solutions.py``
runs every check, and the tests paste these into the notebook's exercise cells and grade it.
"""
from minivllm.learn import exercises


def decode_load_plan(block_size, num_prompt_tokens, num_local_hit_tokens):
    # The prefill instance stores whole blocks strictly before the last prompt token: that token's
    # logits give the first output token, so the decode instance computes it in any case.
    stored = (num_prompt_tokens - 1) // block_size * block_size
    # Local prefix-cache hits are neither loaded nor recomputed.
    load = list(range(num_local_hit_tokens, stored))
    recompute = list(range(max(stored, num_local_hit_tokens), num_prompt_tokens))
    return load, recompute


class MyKVConnector(exercises.InMemoryConnector):
    def _stored_prefix(self, prompt_token_ids):
        n = (len(prompt_token_ids) - 1) // self.block_size * self.block_size
        return prompt_token_ids[:n]

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        prefix = self._stored_prefix(request.prompt_token_ids)
        # Prefill (a producer only) always sees 0; only what lies beyond the local hit counts.
        if not self.is_consumer or len(prefix) <= num_computed_tokens or not self.is_stored(prefix):
            return 0, False
        return len(prefix) - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens > 0:
            self.requests_need_load[request.request_id] = self._stored_prefix(request.prompt_token_ids)

    def build_connector_meta(self, scheduler_output):
        meta = exercises.InMemoryConnectorMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            block_ids = list(req.block_ids[0])
            load = self.requests_need_load.pop(req.req_id, None)
            if load is not None:
                meta.add_request(req.req_id, load, block_ids, is_store=False)
                continue
            prefix = self._stored_prefix(req.prompt_token_ids)
            if self.is_producer and prefix and not self.is_stored(prefix):
                meta.add_request(req.req_id, prefix, block_ids, is_store=True)
        return meta


if __name__ == "__main__":
    exercises.check_decode_load_plan(decode_load_plan)
    exercises.check_kv_connector(MyKVConnector)
