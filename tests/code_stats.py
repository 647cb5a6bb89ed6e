"""Readability numbers for the article's path: code lines of a function and of a file, and the
*walks*: what a reader stepping through one verify step or one P/D consumer request walks through,
found by running it under ``sys.settrace`` (files entered, distinct lines executed, functions entered,
the files in the order first entered). Used by tests/test_readable_core.py and the README's reading
order; ``python tests/code_stats.py [MODEL]`` prints both walks.

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


def import_graph(root: str = os.path.join(ROOT, "minivllm")) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, counting every import: at the top, inside
    functions and under ``TYPE_CHECKING``. ``from a.b import c`` counts ``a.b.c`` when it is a
    module, else ``a.b``."""
    base = os.path.dirname(root)
    mods = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        with open(path) as fh:
            tree = ast.parse(fh.read())
        package = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                graph[mod].update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                parent = node.module or ""
                if node.level:
                    parent = ".".join(package[:len(package) - node.level + 1] + ([parent] if parent else []))
                for a in node.names:
                    sub = f"{parent}.{a.name}"
                    if sub in mods:
                        graph[mod].add(sub)
                    elif parent in mods:
                        graph[mod].add(parent)
    return graph


def import_circles(graph: "dict[str, set[str]] | None" = None) -> list[list[str]]:
    """The groups of modules that import one another in a circle (strongly connected, more than
    one module), each sorted; counting every import (``import_graph``)."""
    graph = import_graph() if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


# The two walks, each on the plain path (the eager attention, plain F.linear, the article's
# rejection rule), run in a fresh process so that nothing else has been imported or cached:
# - "verify": one ``LLMEngine.step()`` whose running request carries n-gram drafts (the steps
#   before it, prefill and the first drafts, are not traced);
# - "pd": one consumer request with ``SharedStorageConnector``, its producer having run first
#   (``LLM.generate`` of the consumer, traced whole). A first producer/consumer pair on another
#   prompt warms the lazily imported modules, so that the walk counts the request, not the imports.
WALK_ENV = {"MINIVLLM_LINEAR_ROUTE": "f_linear", "MINIVLLM_REJECTION_SAMPLER": "reference"}

_WALK_SCRIPT = """
import json, os, sys, tempfile, threading
import torch
from minivllm import LLM, SamplingParams
from minivllm.config import KVTransferConfig

PKG = os.path.dirname(sys.modules["minivllm"].__file__) + os.sep
order, lines, funcs = [], set(), set()

def _local(frame, event, arg):
    if event == "line":
        lines.add((frame.f_code.co_filename, frame.f_lineno))
    return _local

def _global(frame, event, arg):
    code = frame.f_code
    if not code.co_filename.startswith(PKG):
        return None
    if code.co_filename not in order:
        order.append(code.co_filename)
    funcs.add((code.co_filename, code.co_firstlineno, code.co_name))
    return _local   # its lines are counted as they run (the "def" line itself is not)

def traced(fn):
    order.clear(); lines.clear(); funcs.clear()
    threading.settrace(_global)
    sys.settrace(_global)
    try:
        fn()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    rel = lambda f: os.path.relpath(f, PKG)
    per_file = {}
    for f, _ in lines:
        per_file[rel(f)] = per_file.get(rel(f), 0) + 1
    return {"files": [rel(f) for f in order], "lines": len(lines), "functions": len(funcs),
            "lines_per_file": per_file,
            "functions_list": sorted(f"{rel(f)}:{n}" for f, _, n in funcs)}

result = {}
if "verify" in WALKS:
    torch.manual_seed(0)
    spec = {"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 3,
            "num_speculative_tokens": 3}
    llm = LLM(model=MODEL, skip_tokenizer_init=True, speculative_config=spec,
              attention_backend="torch")
    engine = llm.llm_engine
    # A prompt that repeats itself, so the model goes on repeating it and the n-gram proposer
    # finds a match (seeded: the same drafts every run).
    engine.add_request("0", {"prompt_token_ids": [504, 2365, 314, 253, 1345, 30] * 6},
                       SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, ignore_eos=True,
                                      seed=0))
    for _ in range(32):
        engine.step()
        if any(r.spec_token_ids for r in engine.scheduler.running):
            break
    assert any(r.spec_token_ids for r in engine.scheduler.running), "no drafts to verify"
    result["verify"] = traced(engine.step)
if "pd" in WALKS:
    ktc = KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both",
                           kv_connector_extra_config={"shared_storage_path": tempfile.mkdtemp()})
    def pair(prompt, traced_consumer):
        producer = LLM(model=MODEL, skip_tokenizer_init=True, kv_transfer_config=ktc,
                       attention_backend="torch")
        producer.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        consumer = LLM(model=MODEL, skip_tokenizer_init=True, kv_transfer_config=ktc,
                       attention_backend="torch")
        run = lambda: consumer.generate([prompt], SamplingParams(temperature=0, max_tokens=8),
                                        use_tqdm=False)
        return traced(run) if traced_consumer else run()
    pair({"prompt_token_ids": list(range(41, 80))}, False)
    result["pd"] = pair({"prompt_token_ids": list(range(1, 40))}, True)
print("WALKS " + json.dumps(result))
"""


def walks(model: str, names: tuple[str, ...] = ("verify", "pd"),
          env: "dict[str, str] | None" = None, timeout: float = 900) -> dict[str, dict]:
    """Run the walks ``names`` in a fresh process; -> {walk: {"files": [in the order first
    entered], "lines": distinct lines executed, "functions": functions entered,
    "lines_per_file": {file: lines}, "functions_list": ["file:name", ...]}}, files relative to
    minivllm/."""
    script = f"MODEL = {model!r}\nWALKS = {list(names)!r}\n" + _WALK_SCRIPT
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **WALK_ENV, **(env or {})}, timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith("WALKS "):
            return json.loads(line[len("WALKS "):])
    raise RuntimeError(f"the walk failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


if __name__ == "__main__":    # python tests/code_stats.py [MODEL]: both walks, file by file
    from minivllm.model_executor.model_loader import DEFAULT_MODEL, resolve_model_path
    found = walks(resolve_model_path(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
    for name, w in found.items():
        print(f"{name}: {len(w['files'])} files, {w['lines']} lines, {w['functions']} functions")
        for f in w["files"]:
            print(f"  {w['lines_per_file'].get(f, 0):5d}  {f}"
                  f"  ({file_code_lines(os.path.join(ROOT, 'minivllm', f))} code lines)")
