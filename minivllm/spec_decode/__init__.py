"""Speculative-decoding proposers (vllm/v1/spec_decode/), created by ``create_drafter``.

Every drafter is a ``Proposer`` (base_proposer.py): ``load_model(target_model)`` (article "Setup /
load model": a no-op for n-gram) and ``propose_for_batch(runner, limits, scheduler_output) ->
{req_id: drafts}``, called by ``ModelRunner.propose_draft_token_ids`` once per step with each
request's draft limit; what a drafter needs is declared (``uses_target_hidden_states``,
``has_kv_cache``). Drafters with ``uses_target_hidden_states = True`` read the target's step
(``runner.target_step_outputs``, see utils.py).

``DRAFTERS`` names each method's class by its dotted path; ``create_drafter`` builds the one the
configuration names.
"""
from __future__ import annotations

from typing import Any

from minivllm.utils import resolve_obj_by_qualname

DRAFTERS = {
    "ngram": "minivllm.spec_decode.ngram_proposer.NgramProposer.from_config",
    "draft_model": "minivllm.spec_decode.draft_model.DraftModelProposer",
    "eagle": "minivllm.spec_decode.eagle.EagleProposer",       # heads: models/llama_eagle.py
    "eagle3": "minivllm.spec_decode.eagle.EagleProposer",      # heads: models/llama_eagle3.py
    "medusa": "minivllm.spec_decode.medusa.MedusaProposer",    # heads: models/medusa.py
    "suffix": "minivllm.spec_decode.suffix_decoding.SuffixDecodingProposer",
}


def create_drafter(vllm_config: Any, device: Any, dtype: Any) -> Any:
    """Article "Setup / init device": the ``Proposer`` for ``speculative_config.method``."""
    method = vllm_config.speculative_config.method
    if method not in DRAFTERS:
        raise ValueError(f"unknown speculative method {method!r}")
    return resolve_obj_by_qualname(DRAFTERS[method])(vllm_config, device, dtype)
