"""Readability numbers for the article's path: code lines of a function, and the minivllm lines a
script loads. Used by tests/test_readable_core.py and the README's reading order.

A *code line* is a line of a function's source that is not blank, not a comment and not part of its
docstring: what a reader stepping through it has to read.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

from minivllm.utils import resolve_obj_by_qualname

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve(qualname: str, file: str) -> Any:
    """``"Scheduler.schedule"`` in ``"core/sched/scheduler.py"`` -> the function object."""
    module = "minivllm." + file[:-3].replace("/", ".")
    return inspect.unwrap(resolve_obj_by_qualname(f"{module}.{qualname}"))


def _source_lines(func: Any, signature: bool) -> list[str]:
    """``func``'s body lines after its docstring; with ``signature``, its decorators and ``def``
    lines first."""
    source = textwrap.dedent(inspect.getsource(func))
    body = ast.parse(source).body[0].body
    doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str)
    rest = body[1:] if doc else body
    lines = source.splitlines()
    code = lines[rest[0].lineno - 1:] if rest else []
    return lines[:body[0].lineno - 1] + code if signature else code


def code_lines(func: Any) -> int:
    """Code lines of the body only: the decorators and the signature are not counted."""
    return sum(1 for line in _source_lines(func, signature=False)
               if line.strip() and not line.strip().startswith("#"))


def code_text(func: Any) -> str:
    """The function's source without its docstring and comment lines (what the name rules read)."""
    return "\n".join(line.split("  #")[0] for line in _source_lines(func, signature=True)
                     if not line.strip().startswith("#"))


_REPORT = """
import json as _json, os as _os, sys as _sys
_pkg = _os.path.dirname(_sys.modules["minivllm"].__file__)
_files = sorted(m.__file__ for n, m in list(_sys.modules.items())
                if n.split(".")[0] == "minivllm" and getattr(m, "__file__", None))
print("LOADED " + _json.dumps({_os.path.relpath(f, _pkg): sum(1 for _ in open(f)) for f in _files}))
"""


def loaded_lines(script: str, env: "dict[str, str] | None" = None, cwd: str = ROOT,
                 timeout: float = 900) -> dict[str, int]:
    """Run the Python source ``script`` in a fresh process; -> {file under minivllm/: its line
    count} for every minivllm module it imported."""
    out = subprocess.run([sys.executable, "-c", script + _REPORT], cwd=cwd,
                         env={**os.environ, **(env or {})}, capture_output=True, text=True,
                         timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith("LOADED "):
            return json.loads(line[len("LOADED "):])
    raise RuntimeError(f"the script failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def package_file_lines(root: str = os.path.join(ROOT, "minivllm")) -> dict[str, int]:
    """Lines (all of them) of every ``.py`` file under ``root``, by path relative to it."""
    counts = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    counts[os.path.relpath(path, root)] = sum(1 for _ in fh)
    return counts


def file_code_lines(path: str) -> int:
    """Code lines of a whole file: lines that are not blank, not only a comment and not part of a
    docstring (the module's, a class's or a function's)."""
    import io
    import tokenize
    with open(path) as fh:
        source = fh.read()
    skip: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                skip.update(range(body[0].lineno, body[0].end_lineno + 1))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        code.update(line for line in range(tok.start[0], tok.end[0] + 1) if line not in skip)
    return len(code)


# The reading path (issue "the core, read beside the article"): both article examples, the n-gram
# one and the SharedStorage P/D one, in one process on the plain path (the eager attention and the
# plain F.linear), with every minivllm module they import counted in code lines.
READING_PATH = """
import tempfile
from minivllm import LLM, SamplingParams
from minivllm.config import KVTransferConfig
spec = {'method': 'ngram', 'prompt_lookup_max': 5, 'prompt_lookup_min': 3, 'num_speculative_tokens': 3}
LLM(model=MODEL, skip_tokenizer_init=True, speculative_config=spec, attention_backend='torch').generate(
    [{'prompt_token_ids': [1, 2, 3, 1, 2, 3, 1, 2]}], SamplingParams(temperature=0.8, top_p=0.95),
    use_tqdm=False)
ktc = KVTransferConfig(kv_connector='SharedStorageConnector', kv_role='kv_both',
                       kv_connector_extra_config={'shared_storage_path': tempfile.mkdtemp()})
prompt = {'prompt_token_ids': list(range(1, 40))}
for n in (1, 8):
    LLM(model=MODEL, skip_tokenizer_init=True, kv_transfer_config=ktc, attention_backend='torch').generate(
        [prompt], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
"""

_CODE_REPORT = """
import json as _json, os as _os, sys as _sys
_pkg = _os.path.dirname(_sys.modules["minivllm"].__file__)
print("LOADED " + _json.dumps(sorted(_os.path.relpath(m.__file__, _pkg)
                                     for n, m in list(_sys.modules.items())
                                     if n.split(".")[0] == "minivllm" and getattr(m, "__file__", None))))
"""


def reading_path(model: str, env: "dict[str, str] | None" = None,
                 timeout: float = 900) -> dict[str, int]:
    """{file under minivllm/: its code lines} for every minivllm module the reading path imports."""
    script = f"MODEL = {model!r}\n" + READING_PATH + _CODE_REPORT
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "MINIVLLM_LINEAR_ROUTE": "f_linear", **(env or {})},
                         timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith("LOADED "):
            pkg = os.path.join(ROOT, "minivllm")
            return {f: file_code_lines(os.path.join(pkg, f)) for f in json.loads(line[7:])}
    raise RuntimeError(f"the script failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


if __name__ == "__main__":    # python tests/code_stats.py [MODEL]: the reading path, file by file
    from minivllm.model_executor.model_loader import DEFAULT_MODEL, resolve_model_path
    counts = reading_path(resolve_model_path(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
    for f, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"{n:6d}  {f}")
    print(f"{sum(counts.values()):6d}  code lines in {len(counts)} modules")
