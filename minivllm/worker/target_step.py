"""The target's step as the learned drafters (EAGLE, EAGLE-3, Medusa) read it: a
``TargetStepOutputs`` (spec_decode/utils.py) made from what ``execute_model`` left for
``sample_tokens`` (``ExecuteModelState``, worker/outputs.py). ``propose_draft_token_ids`` loads this
only for a drafter with ``uses_target_hidden_states``; n-gram never reads the target's states.
"""
from __future__ import annotations

from minivllm.spec_decode.utils import TargetStepOutputs
from minivllm.worker.outputs import ExecuteModelState


def target_step_outputs(state: ExecuteModelState,
                        sampled_token_ids: list[list[int]]) -> TargetStepOutputs:
    """The step's inputs and slots on the host, its hidden states (and EAGLE-3's aux streams) on
    the device, with this step's sampled tokens."""
    md = state.attn_metadata
    return TargetStepOutputs(
        state.input_ids.cpu().numpy(), state.positions.cpu().numpy(),
        md.slot_mapping.cpu().numpy(), md.query_start_loc.cpu().numpy(), state.seq_lens,
        state.hidden_states, state.aux_hidden_states, state.logits_indices,
        state.spec_decode_metadata, sampled_token_ids)
