"""The exercise checks fail on the naive answers a learner writes first (issue: "the checks pass a
NaN residual and a producer that never loads under kv_both"), and name the learner's own class."""
from __future__ import annotations

import pytest
import torch

from minivllm.learn import exercises
from minivllm.learn.exercises import ExerciseCheckError


def naive_residual(p_target, p_draft):
    residual = (p_target - p_draft).clamp_min(0)
    return residual / residual.sum()          # 0 / 0 = NaN when p_draft == p_target


def residual_with_convention(p_target, p_draft):
    residual = (p_target - p_draft).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else p_target.clone()


def test_the_residual_check_fails_on_nan_and_states_the_convention(capsys):
    with pytest.raises(ExerciseCheckError, match="draft equals target") as e:
        exercises.check_residual_distribution(naive_residual)
    assert "NaN" in str(e.value) and "return p_target itself" in str(e.value)
    assert exercises.check_residual_distribution(residual_with_convention) is None


def test_the_residual_check_names_a_renamed_parameter():
    def renamed(p, q):
        return residual_with_convention(p, q)
    with pytest.raises(ExerciseCheckError, match="TypeError.*p_target"):
        exercises.check_residual_distribution(renamed)


class _Connector(exercises.InMemoryConnector):
    """The solution's scheduler half, with the lookup rule left to subclasses."""

    def _stored_prefix(self, prompt_token_ids):
        n = (len(prompt_token_ids) - 1) // self.block_size * self.block_size
        return prompt_token_ids[:n]

    def _lookup(self, request, num_computed_tokens):
        prefix = self._stored_prefix(request.prompt_token_ids)
        if len(prefix) <= num_computed_tokens or not self.is_stored(prefix):
            return 0, False
        return len(prefix) - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens > 0:
            self.requests_need_load[request.request_id] = self._stored_prefix(request.prompt_token_ids)

    def build_connector_meta(self, scheduler_output):
        meta = exercises.InMemoryConnectorMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            load = self.requests_need_load.pop(req.req_id, None)
            if load is not None:
                meta.add_request(req.req_id, load, list(req.block_ids[0]), is_store=False)
                continue
            prefix = self._stored_prefix(req.prompt_token_ids)
            if self.is_producer and prefix and not self.is_stored(prefix):
                meta.add_request(req.req_id, prefix, list(req.block_ids[0]), is_store=True)
        return meta


class ProducerNeverLoads(_Connector):
    """The literal reading of "a producer always answers 0": wrong under kv_both."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self.is_producer:
            return 0, False
        return self._lookup(request, num_computed_tokens)


class ByRole(_Connector):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self.is_consumer:
            return 0, False
        return self._lookup(request, num_computed_tokens)


def test_the_connector_check_fails_a_producer_rule_under_kv_both_and_names_the_class(capsys):
    with pytest.raises(ExerciseCheckError) as e:
        exercises.check_kv_connector(ProducerNeverLoads)
    text = str(e.value)
    assert "ProducerNeverLoads.get_num_new_matched_tokens" in text and "kv_both" in text, text
    assert "MyKVConnector" not in text
    assert exercises.check_kv_connector(ByRole)
    assert "kv_both instance ran through it" in capsys.readouterr().out


def num_chunks(num_prompt_tokens, block_size=16, chunk_size=64):
    """Notebook 03's exercise "how many chunks does a prompt of n tokens match?", solved."""
    stored = (num_prompt_tokens - 1) // block_size * block_size   # whole blocks below the last token
    return -(-stored // chunk_size)                                # ceil


def test_notebook_03_chunks_solution_agrees_with_the_connector():
    """The exercise ships unsolved; its solution (above) gives the connector's own count."""
    from types import SimpleNamespace
    from minivllm.distributed.kv_transfer.redis_store_connector import RedisStoreConnector
    stand_in = SimpleNamespace(_block_size=16, _chunk_size=64)
    for n in (1, 16, 17, 64, 65, 80, 81, 200, 1000):
        assert num_chunks(n) == RedisStoreConnector.num_prompt_chunks(stand_in, n), n


def _walk(rule):
    """A greedy walk by frequency; ``rule(prob, ratio, min_token_prob)`` -> (keep?, prob shown)."""
    def walk_suffix_tree(node, max_tokens, min_token_prob):
        tokens, probs, prob = [], [], 1.0
        while len(tokens) < max_tokens and node["children"]:
            token, child = node["children"][0]
            ratio = child["count"] / node["count"]
            prob *= ratio
            keep, shown = rule(prob, ratio, min_token_prob)
            if not keep:
                break
            tokens.append(token)
            probs.append(shown)
            node = child
        return tokens, probs
    return walk_suffix_tree


def test_the_suffix_walk_check_names_the_case_and_hints_at_the_common_mistakes(capsys):
    """A per-step ratio fails on the running-product case with the per-step hint; `<=` at the
    boundary fails on the case exactly at min_token_prob with the boundary hint; the right rule
    passes every case."""
    per_step = _walk(lambda prob, ratio, m: (ratio >= m, ratio))
    with pytest.raises(ExerciseCheckError, match=r"(?s)case 'the running product.*hint: these "
                                                 r"are per-step ratios"):
        exercises.check_walk_suffix_tree(per_step)
    at_most = _walk(lambda prob, ratio, m: (prob > m, prob))
    with pytest.raises(ExerciseCheckError, match=r"(?s)case 'a probability exactly min_token_prob"
                                                 r".*hint: stopped at a probability equal"):
        exercises.check_walk_suffix_tree(at_most)
    assert exercises.check_walk_suffix_tree(_walk(lambda prob, ratio, m: (prob >= m, prob))) is None
    assert "8 hand-made cases and 200 cases" in capsys.readouterr().out


def test_the_suffix_check_keeps_its_answers_as_data():
    """No importable solution: the expected walks are the check's case table (and the engine's
    SuffixTree.walk for the random trees), and every case says what it tests."""
    from minivllm.learn.exercises import suffix
    assert not [n for n in dir(suffix) if n.startswith("reference")]
    labels = [case[0] for case in suffix.HAND_CASES]
    assert len(set(labels)) == len(labels)
    assert any(c[3] in c[5] for c in suffix.HAND_CASES)       # a probability == min_token_prob
