"""An import adapter: vLLM 0.32's names, minivllm's classes. On ``sys.path`` only in the subprocess
that runs vLLM's unit tests (``run.py``); the real vLLM never sees it. Its modules rename and
translate constructors; names minivllm lacks resolve to stand-ins that raise (``_missing.py``)."""
from vllm import _missing

_missing.install()

from vllm.sampling_params import SamplingParams  # noqa: E402

__getattr__ = _missing.module_getattr(__name__)
__all__ = ["SamplingParams"]
