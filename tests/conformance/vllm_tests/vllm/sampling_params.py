"""vllm/sampling_params.py -> minivllm/sampling_params.py."""
from minivllm.sampling_params import SamplingParams as _SamplingParams
from vllm import _missing

# Sampling features of their own issue (logprobs, penalties, bad words, allowed token ids) are real
# minivllm fields; the few vLLM fields minivllm has no counterpart for raise when set.
_ABSENT = {"structured_outputs": None, "guided_decoding": None, "output_kind": None,
           "detokenize": True, "flat_logprobs": False, "thinking_token_budget": None}


class SamplingParams(_SamplingParams):
    def __init__(self, **kwargs):
        for name, default in _ABSENT.items():
            if name in kwargs and kwargs.pop(name) not in (default,):
                _missing._raise(f"vllm.SamplingParams({name}=...)")
        super().__init__(**kwargs)

    def update_from_generation_config(self, generation_config: dict, eos_token_id=None):
        """vLLM's: the model's EOS id (the engine's Request takes it from here), then
        generation_config's other EOS ids join ``stop_token_ids``. vLLM also adds the EOS id to
        ``_all_stop_token_ids`` for its min_tokens processor; minivllm's ``_all_stop_token_ids`` are
        the stop ids only (``check_stop``), and min_tokens masks EOS through ``_eos_token_id``."""
        self._model_eos_token_id = eos_token_id
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is not None:
            eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
            eos_ids.discard(eos_token_id)
            if eos_ids and not self.ignore_eos:
                self.stop_token_ids = list(eos_ids | set(self.stop_token_ids))
                self._all_stop_token_ids = set(self.stop_token_ids)


__getattr__ = _missing.module_getattr(__name__)
