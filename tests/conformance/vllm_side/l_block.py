"""Case l, vLLM side: vLLM 0.32's rejection kernel (``v1/worker/gpu/spec_decode/
rejection_sampler_utils.py``, Model Runner V2's) with ``use_block_verification`` on and off, run
by Triton's interpreter on CPU tensors (no engine).

The vLLM CPU build turns Triton off (``HAS_TRITON = False``: its Triton has no CPU backend), so
``vllm.triton_utils`` hands out placeholders; this script gives it the real ``triton`` modules
before the kernel's module is imported, with ``TRITON_INTERPRET=1``, and calls ``rejection_sample``
directly.

Input: ``{"logits": [[k + 1 rows of vocab floats]], "drafts": [k ids], "draft_logits": null or
[[k rows]], "num_requests": N}``: N copies of one request (the same logits and drafts, temperature
1, seeds 1..N). Output: ``{"block": [[num_sampled, last token]] * N}`` (the standard rule is
case d's).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.language.extra.libdevice as tldevice  # noqa: E402
import vllm.triton_utils as triton_utils  # noqa: E402
from common import read_input, write_output  # noqa: E402

triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
triton_utils.HAS_TRITON = True
from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample  # noqa: E402

if __name__ == "__main__":
    inp = read_input()
    n, drafts = inp["num_requests"], inp["drafts"]
    k = len(drafts)
    logits = torch.tensor(inp["logits"], dtype=torch.float32).repeat(n, 1)
    # draft_sampled[start + i + 1] is draft i; the first slot (the last sampled token) is unused.
    draft_sampled = torch.tensor([0] + drafts, dtype=torch.int64).repeat(n)
    draft_logits = None
    if inp["draft_logits"] is not None:
        draft_logits = torch.tensor(inp["draft_logits"], dtype=torch.float32).expand(n, k, -1).contiguous()
    cu = torch.arange(0, n + 1, dtype=torch.int32) * (k + 1)
    idx_mapping = torch.arange(n, dtype=torch.int32)
    result = {}
    for name, block in (("block", True),):
        sampled, num_sampled = rejection_sample(
            logits, draft_logits, draft_sampled, cu, torch.arange(n * (k + 1), dtype=torch.int64),
            idx_mapping, idx_mapping.repeat_interleave(k + 1),
            torch.arange(k + 1, dtype=torch.int32).repeat(n), torch.ones(n),
            torch.arange(1, n + 1, dtype=torch.int64), k, use_block_verification=block)
        result[name] = [[int(m), int(row[m - 1])] for row, m in zip(sampled.tolist(),
                                                                    num_sampled.tolist())]
    write_output(result)
