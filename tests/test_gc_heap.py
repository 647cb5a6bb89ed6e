"""``utils.frozen_gc_heap`` (vLLM's ``freeze_gc_heap``, scoped) and ``LLM.generate``, whose steps
run inside it: the objects that existed before a call are out of the cyclic collector's walks
while it runs, and back in once it returns, whether it returned or raised."""
from __future__ import annotations

import gc

import pytest

from minivllm.sampling_params import SamplingParams
from minivllm.utils import frozen_gc_heap
from tests.conftest import tiny_llm


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_objects_made_before_entry_are_frozen_until_exit_and_a_frozen_heap_is_left_alone():
    assert gc.get_freeze_count() == 0
    before = _Cycle()
    with frozen_gc_heap():
        assert gc.get_freeze_count() > 0
        assert not any(o is before for o in gc.get_objects())     # the collector's lists
        made_inside = _Cycle()
        assert any(o is made_inside for o in gc.get_objects(generation=0))
    assert gc.get_freeze_count() == 0
    assert any(o is before for o in gc.get_objects(generation=2))

    gc.freeze()                       # someone else froze it: exit must not thaw their heap
    try:
        frozen = gc.get_freeze_count()
        with frozen_gc_heap():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_generate_steps_with_the_heap_frozen_and_thaws_it_even_when_a_step_raises(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    engine = llm.llm_engine
    step, seen = engine.step, []

    def recording_step():
        seen.append(gc.get_freeze_count())
        return step()
    engine.step = recording_step
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0,
                                                                          max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert seen and all(n > 0 for n in seen)
    assert gc.get_freeze_count() == 0

    def failing_step():
        raise RuntimeError("step failed")
    engine.step = failing_step
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    assert gc.get_freeze_count() == 0
