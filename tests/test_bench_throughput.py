"""``bench throughput --sampling``: the cells with vLLM 0.32's sampling options run the same
requests with logprobs or penalties, every requested token produced; logprobs leave the greedy
tokens as they are."""
import pytest

from minivllm.bench import throughput


def test_sampling_cells(smollm2_dir):
    cells = {v: throughput.run_cell("minivllm", "float32", "single", 6, v) for v in throughput.SAMPLING}
    assert all(c["tokens"] == 6 and c["tokens_per_s"] > 0 for c in cells.values())
    assert cells["logprobs"]["first_output"] == cells["plain"]["first_output"]


def test_unknown_sampling_variant_is_refused():
    with pytest.raises(SystemExit, match="--sampling"):
        throughput.main(["--sampling", "plain,fast"])
