"""``SpeculativeConfig``'s checks for method ``"suffix"`` (vLLM 0.32: ``_validate_suffix_decoding``
in ``config/speculative.py``). ``config.py`` loads this only when that method is asked for, so the
article's configuration reads without the options of a method that came after it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.config import SpeculativeConfig


def check_suffix_options(spec: "SpeculativeConfig") -> None:
    """vLLM 0.32's ``_validate_suffix_decoding`` ranges (config/speculative.py); no draft model."""
    for name, kind, lo, hi in (("max_tree_depth", int, 1, None),
                               ("max_cached_requests", int, 0, None),
                               ("max_spec_factor", float, 0, None),
                               ("min_token_prob", float, 0, 1)):
        value = getattr(spec, "suffix_decoding_" + name)
        if (isinstance(value, bool) or not isinstance(value, (kind, int)) or value < lo
                or (hi is not None and value > hi)):
            allowed = f"in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}" \
                if kind is int else f">= {lo}"
            raise ValueError(f"speculative_config.suffix_decoding_{name} must be {allowed}, "
                             f"got {value!r}.")
    if spec.model is not None or spec.draft_num_layers is not None:
        raise ValueError("speculative_config method 'suffix' drafts from the requests' own "
                         "tokens: it takes no 'model' or 'draft_num_layers'.")
