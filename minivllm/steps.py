"""Article-step breakpoints: a stable id for every numbered step of the article ("Inside vLLM",
part 3), and the statement in the engine after which that step's values sit in local variables.

The engine's functions carry no breakpoint code. ``STOPS`` below names, for every id, the statement
the stop follows (in the function ``step_table.py`` gives for that id) and the condition under which
it stops. Arming an id recompiles that one function from its source with one statement added after
the anchor, on the anchor's own line::

    if at_step("spec.4", request.spec_token_ids): breakpoint()

so the builtin ``breakpoint()`` runs in the article function's own frame, with its locals, and
``PYTHONBREAKPOINT`` picks the debugger (pdb, ipdb, pudb, VS Code's debugpy; ``0`` disables). The
debugger shows the file as it is; a function nobody asked to stop in runs its original code, so a
run without breakpoints pays nothing. ``at_step`` says whether to stop (each id stops once per
``LLM``) and prints one line naming the step.

Ask with ``MINIVLLM_BREAK=spec.4,pd.lookup`` (or ``all``, or a group ``spec`` / ``pd``) or
``LLM(..., break_at=["spec.4"])``. ``python -m minivllm.tour spec|pd`` walks them in order. At exit,
every requested id that never stopped is named, with the reason where it can be known.
The ids and what each shows are in ``step_table.py``, read only once someone asks for a step
(``steps.REGISTRY``, ``steps.STEPS``, ``steps.GROUPS`` and ``steps.Step`` load it).
"""
from __future__ import annotations

import ast
import atexit
import importlib
import inspect
import os
import sys
import textwrap
from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:
    from minivllm.step_table import Step

_TABLE_NAMES = ("Step", "STEPS", "REGISTRY", "GROUPS", "markdown_table")

# id -> (the statement the stop follows: the text its first line starts with, the condition).
# The function is the step's own (step_table.py); OTHER_SITES adds a second function for an id.
STOPS: dict[str, tuple[str, Optional[str]]] = {
    "spec.setup": ("self.rejection_sampler = RejectionSampler(", None),
    "spec.load": ("for name, layer in self.drafter.attn_layers()", None),
    "spec.1.forward": ("with self.maybe_get_kv_connector_output(so) as kv_connector_output:",
                       "so.scheduled_new_reqs"),
    "spec.1": ("self.execute_model_state = ExecuteModelState(", "so.scheduled_new_reqs"),
    "spec.2": ("self.target_step_outputs = None", "any(drafts.values())"),
    "spec.3": ("request.spec_token_ids = list(drafts)", "drafts"),
    "spec.4": ("if new_blocks is None:", "request.spec_token_ids"),
    "spec.5": ("batch.spec_token_ids[req_id] = list(drafts)", "drafts"),
    "spec.6": ("draft_token_ids = self.input_batch.token_ids_cpu[", None),
    "spec.7": ("output, uniform_probs = rejection_sample(", None),
    "spec.8": ("if check_stop(request, self.max_model_len, self.detokenize):", None),
    "pd.init.worker": ("self.kv_connector = init_worker_distributed_environment(",
                       "self.kv_connector is not None"),
    "pd.init.scheduler": ("self.connector = KVConnectorFactory.create_connector(", None),
    "pd.lookup": ("request.num_external_computed_tokens = num_external_computed_tokens", None),
    "pd.update_state": ("self.connector.update_state_after_alloc(", None),
    "pd.build_meta": ("scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(",
                      "scheduler_output.kv_connector_metadata"),
    "pd.enter": ("connector.start_load_kv(get_forward_context())", None),
    "pd.layer_load": ("connector.wait_for_layer_load(self.layer_name)", None),
    "pd.layer_save": ("connector.save_kv_layer(self.layer_name", None),
    "pd.exit": ("connector.wait_for_save()", None),
    "pd.async_wait": ('trace.record("remote_kv_wait"', None),
    "pd.async_ready": ('trace.record("remote_kv_ready"', None),
}
# A stop whose anchor is a compound statement (if / for) stops inside its block, before the block's
# first statement; all others stop after the anchor. (id, module, function) for a second site:
OTHER_SITES = (("pd.enter", "minivllm.distributed.kv_transfer.vllm_today", "get_kv_connector_output",
                "if not start_after_forward:"),)
INSIDE_BLOCK = {"spec.1.forward", "spec.8"}
# Why a requested stop may never come: (a stop that, if it never came either, explains it, why).
# Those stops are compiled in as witnesses beside the requested ones (they record, never stop).
_WHY_NOT: dict[str, tuple[str, str]] = {
    "spec": ("spec.setup", "the engine has no speculative_config"),
    "spec.drafts": ("spec.2", "no request had drafts (n-gram drafts need a prompt that repeats "
                              "itself)"),
    "pd": ("pd.init.scheduler", "the engine has no kv_transfer_config"),
    "pd.async": ("pd.async_wait", "no load was asynchronous (SharedStorageConnector loads in the "
                                  "forward)"),
}
_NEEDS = {"spec.3": "spec.drafts", "spec.4": "spec.drafts", "spec.5": "spec.drafts",
          "spec.6": "spec.drafts", "spec.7": "spec.drafts", "pd.async_wait": "pd.async",
          "pd.async_ready": "pd.async"}


def __getattr__(name: str) -> Any:
    """The step table's names, loaded on first use (a run without breakpoints never reads it)."""
    if name in _TABLE_NAMES:
        from minivllm import step_table
        return getattr(step_table, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# id -> True for every requested id that has not stopped yet.
BREAKS: dict[str, bool] = {}
_requested: tuple[str, ...] = ()
_asked: dict[str, None] = {}       # every id requested in this process
_seen: set[str] = set()            # every compiled-in stop whose condition held (witnesses too)
_original: dict[Any, Any] = {}     # function -> its code before a stop was compiled in
current: Optional[Step] = None     # the step at_step() last stopped at (read by the tour's hook)
quiet = False                      # the tour prints its own header


def parse(ids: "str | Iterable[str] | None") -> tuple[str, ...]:
    """``"spec.4,pd.lookup"`` / ``["spec.4"]`` / ``"all"`` → the ids, in registry order."""
    items = [i.strip() for i in (ids.split(",") if isinstance(ids, str) else ids or ())]
    if not any(items):
        return ()
    from minivllm.step_table import GROUPS, REGISTRY
    wanted: set[str] = set()
    for item in filter(None, items):
        if item in GROUPS:
            wanted.update(GROUPS[item])
        elif item in REGISTRY:
            wanted.add(item)
        else:
            raise ValueError(f"unknown article step {item!r} in break_at / MINIVLLM_BREAK; valid ids: "
                             f"{', '.join(REGISTRY)} (or the groups {', '.join(GROUPS)}).")
    return tuple(i for i in REGISTRY if i in wanted)


def sites(step_id: str) -> list[tuple[Any, str]]:
    """The functions a stop is compiled into, each with the text of its anchor statement."""
    from minivllm.step_table import REGISTRY
    step = REGISTRY[step_id]
    module = importlib.import_module(
        "minivllm." + step.file[:-3].replace("/", ".").removesuffix(".__init__"))
    found = [(_resolve(module, step.function), STOPS[step_id][0])]
    for other_id, module_name, qualname, anchor in OTHER_SITES:
        if other_id == step_id:
            found.append((_resolve(importlib.import_module(module_name), qualname), anchor))
    return found


def _resolve(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return inspect.unwrap(obj)


def anchor_of(func: Any, anchor: str) -> ast.stmt:
    """The one statement of ``func`` whose first line starts with ``anchor`` (ValueError if not
    exactly one), with line numbers as in the file."""
    lines, first = inspect.getsourcelines(func)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first - 1)
    matches = [node for node in ast.walk(tree.body[0]) if isinstance(node, ast.stmt)
               and node is not tree.body[0]
               and lines[node.lineno - first].strip().startswith(anchor)]
    if len(matches) != 1:
        raise ValueError(f"{func.__qualname__}: {len(matches)} statements start with {anchor!r}")
    return matches[0]


def _witnesses(step_id: str) -> list[str]:
    keys = (step_id.split(".")[0], _NEEDS.get(step_id, ""))
    return [_WHY_NOT[k][0] for k in keys if k in _WHY_NOT and _WHY_NOT[k][0] != step_id]


def _compile_stops(func: Any, stops: list[tuple[str, str]]) -> Any:
    """``func``'s code with ``if at_step(step_id, <condition>): breakpoint()`` after each
    ``(step_id, anchor)``'s anchor statement (at the head of its block, for the ids in
    INSIDE_BLOCK), on the anchor's line."""
    lines, first = inspect.getsourcelines(func)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first - 1)
    for step_id, anchor in stops:
        target = anchor_of(func, anchor)
        stop = ast.parse(f"if __import__('minivllm.steps').steps.at_step({step_id!r}, "
                         f"{STOPS[step_id][1] or 'True'}): breakpoint()").body[0]
        block, i = _block_of(tree, target)
        if step_id in INSIDE_BLOCK:
            block, i, line = block[i].body, -1, target.lineno
        else:
            line = target.end_lineno
        block.insert(i + 1, stop)
        for part in ast.walk(stop):   # on the anchor's line: the debugger shows the file as it is
            if hasattr(part, "lineno"):
                part.lineno = part.end_lineno = line
    return _code_of(func, tree)


def _block_of(tree: ast.AST, target: ast.stmt) -> tuple[list, int]:
    """The statement list holding ``target`` (found again by position) and its index there."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            for i, stmt in enumerate(block if isinstance(block, list) else ()):
                if (stmt.lineno, stmt.col_offset) == (target.lineno, target.col_offset):
                    return block, i
    raise ValueError(f"no block holds the statement at line {target.lineno}")


def _code_of(func: Any, tree: ast.Module) -> Any:
    """Compile the function's edited tree; a method goes inside a class of its own class's name,
    so ``super()`` finds its ``__class__`` cell."""
    defn = tree.body[0]
    defn.decorator_list = []
    owner = func.__qualname__.split(".")[-2] if "." in func.__qualname__ else None
    if owner:
        cls = ast.ClassDef(name=owner, bases=[], keywords=[], body=[defn], decorator_list=[])
        tree = ast.Module(body=[ast.copy_location(cls, defn)], type_ignores=[])
    module = compile(ast.fix_missing_locations(tree), func.__code__.co_filename, "exec")
    stack = [module]
    while stack:
        code = stack.pop()
        if code.co_name == func.__code__.co_name and code.co_freevars == func.__code__.co_freevars:
            return code
        stack += [c for c in code.co_consts if hasattr(c, "co_code")]
    raise ValueError(f"cannot recompile {func.__qualname__}")


def configure(break_at: "str | Iterable[str] | None" = None) -> tuple[str, ...]:
    """Arm the breakpoints for a new engine: ``break_at`` if given, else ``$MINIVLLM_BREAK``.
    Called by ``LLM.__init__`` before anything is built. Returns the armed ids."""
    global _requested
    source = break_at if break_at is not None else os.environ.get("MINIVLLM_BREAK")
    _requested = parse(source)
    disarm()
    by_function: dict[Any, list[tuple[str, str]]] = {}
    for step_id in dict.fromkeys(_requested + tuple(w for i in _requested for w in _witnesses(i))):
        for func, anchor in sites(step_id):
            by_function.setdefault(func, []).append((step_id, anchor))
    for func, stops in by_function.items():
        _original[func] = func.__code__
        func.__code__ = _compile_stops(func, stops)
    BREAKS.update(dict.fromkeys(_requested, True))
    _asked.update(dict.fromkeys(_requested))
    return _requested


def disarm() -> None:
    """Every function back to its own code; no id armed."""
    BREAKS.clear()
    for func, code in _original.items():
        func.__code__ = code
    _original.clear()


def at_step(step_id: str, when: Any = True) -> bool:
    """True (once per id and engine) when ``step_id`` is armed and ``when`` is truthy."""
    global current
    if not when:
        return False
    _seen.add(step_id)
    if not BREAKS.get(step_id):
        return False
    del BREAKS[step_id]
    from minivllm.step_table import REGISTRY
    current = REGISTRY[step_id]
    if not quiet:
        caller = sys._getframe(1)
        print(f"minivllm step {step_id}: {current.article} "
              f"[{caller.f_code.co_filename}:{caller.f_lineno} {current.function}]", file=sys.stderr)
    return True


def never_fired() -> list[str]:
    """One line per requested id that never stopped in this process, with why, if known."""
    lines = []
    for step_id in (i for i in _asked if i not in _seen):
        why = ""
        for key in (step_id.split(".")[0], _NEEDS.get(step_id)):
            witness, reason = _WHY_NOT.get(key or "", ("", ""))
            if reason and witness not in _seen:
                why = f": {reason}"
                break
        lines.append(f"minivllm: the requested step {step_id} never stopped{why}.")
    return lines


@atexit.register
def _report() -> None:
    for line in never_fired():
        print(line, file=sys.stderr)


try:   # arm from the environment at import, so engines built without LLM(...) honour it too
    configure()
except ValueError as _e:     # reported again, as an exception, by LLM(...)
    print(f"minivllm: {_e}", file=sys.stderr)
