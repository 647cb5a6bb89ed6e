"""Article-step breakpoints: a stable id for every numbered step of the article ("Inside vLLM",
part 3), and the statement in the engine after which that step's values sit in local variables.

The engine's functions carry no breakpoint code. Each id's row in ``step_table.py`` names the
function, the statement the stop follows (its anchor) and the condition under which it stops.
Arming an id recompiles that one function from its file's syntax tree (the function found by its
code's ``co_firstlineno``, so every line and column stays where the file has it and a traceback's
carets stay under the right expression) with one statement added after the anchor, on the
anchor's own line::

    if at_step("spec.4", request.spec_token_ids): breakpoint()

so the builtin ``breakpoint()`` runs in the article function's own frame, with its locals, and
``PYTHONBREAKPOINT`` picks the debugger (pdb, ipdb, pudb, VS Code's debugpy; ``0`` disables). The
debugger shows the file as it is; a function nobody asked to stop in runs its original code, so a
run without breakpoints pays nothing. ``at_step`` says whether to stop and prints the step, the
values to look at and why they are what they are; its ``file:line`` is where the debugger then
stops, the next line to run (``debugger_line``), not the anchor's own. Each id stops once per
``LLM``: to stop there again, build another ``LLM`` (or call ``steps.configure([...])`` again).

Ask with ``MINIVLLM_BREAK=spec.4,pd.lookup`` (or ``all``, or a group ``spec`` / ``pd``) or
``LLM(..., break_at=["spec.4"])``. ``python -m minivllm.tour spec|pd`` walks them in order. At exit,
every requested id that never stopped is named, with the reason where it can be known.
The ids, what each shows and why (its note) are in ``step_table.py``; ``steps.REGISTRY``,
``steps.STEPS``, ``steps.GROUPS`` and ``steps.Step`` are its names.
"""
from __future__ import annotations

import ast
import atexit
import importlib
import inspect
import linecache
import os
import sys
from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:
    from minivllm.step_table import Step

_TABLE_NAMES = ("Step", "STEPS", "REGISTRY", "GROUPS", "markdown_table")


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
# (file, the stop's line, id) -> the line a debugger that the stop's breakpoint() starts stops at
_resume: dict[tuple[str, int, str], int] = {}
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
    found = [(_resolve(module, step.function), step.anchor)]
    for module_name, qualname, anchor in step.also:
        found.append((_resolve(importlib.import_module(module_name), qualname), anchor))
    return found


def _resolve(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return inspect.unwrap(obj)


def _function_node(func: Any) -> ast.FunctionDef:
    """``func``'s definition in its file's syntax tree, found by its code's ``co_firstlineno`` (the
    ``def`` line, or its first decorator's): line numbers and columns are the file's."""
    code = func.__code__
    lines = linecache.getlines(code.co_filename) or open(code.co_filename).readlines()
    tree = ast.parse("".join(lines), code.co_filename)
    for node in ast.walk(tree):
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name
                and min([node.lineno] + [d.lineno for d in node.decorator_list])
                == code.co_firstlineno):
            return node
    raise ValueError(f"{func.__qualname__}: no definition at {code.co_filename}:{code.co_firstlineno}")


def anchor_of(func: Any, anchor: str, node: Optional[ast.AST] = None) -> ast.stmt:
    """The one statement of ``func`` whose first line starts with ``anchor`` (ValueError if not
    exactly one), with line numbers as in the file."""
    node = node or _function_node(func)
    lines = linecache.getlines(func.__code__.co_filename)
    matches = [stmt for stmt in ast.walk(node) if isinstance(stmt, ast.stmt) and stmt is not node
               and lines[stmt.lineno - 1].strip().startswith(anchor)]
    if len(matches) != 1:
        raise ValueError(f"{func.__qualname__}: {len(matches)} statements start with {anchor!r}")
    return matches[0]


def _compile_stops(func: Any, stops: list[tuple[Any, str]]) -> Any:
    """``func``'s code with ``if at_step(step.id, step.when): breakpoint()`` after each ``(step,
    anchor)``'s anchor statement (at the head of its block, for a step whose ``inside`` is set), on
    the anchor's line."""
    node, inserted = _function_node(func), set()
    for step, anchor in stops:
        target = anchor_of(func, anchor, node)
        stop = ast.parse(f"if __import__('minivllm.steps').steps.at_step({step.id!r}, "
                         f"{step.when}): breakpoint()").body[0]
        block, i = _block_of(node, target)
        if step.inside:
            block, i, line = block[i].body, -1, target.lineno
        else:
            line = target.end_lineno
        block.insert(i + 1, stop)
        for part in ast.walk(stop):   # on the anchor's line: the debugger shows the file as it is
            if hasattr(part, "lineno"):
                part.lineno = part.end_lineno = line
                part.col_offset, part.end_col_offset = target.col_offset, target.col_offset
        inserted.add(id(stop))
        _resume[(func.__code__.co_filename, line, step.id)] = _next_line_event(
            node, block, i + 1, line, inserted)
    return _code_of(func, node)


def _next_line_event(func: ast.AST, block: list, i: int, line: int, inserted: set[int]) -> int:
    """The line of the first line event after ``block[i]`` (a stop on ``line``), where a debugger
    that its ``breakpoint()`` starts stops (pdb's ``set_trace`` waits for the frame's next event):
    the next statement; at the end of a loop's body, the loop's head; of a ``with`` block, its
    ``with`` line (``__exit__``); of a ``try`` body, its ``else`` or ``finally``; of an ``if``
    block, what follows the ``if``; at the end of the function, its return, on ``line`` itself.
    The other stops compiled in (``inserted``) run on lines of their own anchors and are skipped."""
    while True:
        rest = [stmt for stmt in block[i + 1:] if id(stmt) not in inserted]
        if rest:
            return rest[0].lineno
        if block is func.body:
            return line
        parent, field = _parent_of(func, block)
        if parent is None:
            return line
        if isinstance(parent, (ast.For, ast.AsyncFor, ast.While)) and field == "body":
            return parent.lineno
        if isinstance(parent, (ast.With, ast.AsyncWith)):
            return parent.lineno
        if isinstance(parent, ast.Try) and field == "body" and parent.orelse:
            return parent.orelse[0].lineno
        if isinstance(parent, ast.Try) and field != "finalbody" and parent.finalbody:
            return parent.finalbody[0].lineno
        try:
            block, i = _block_of(func, parent)
        except ValueError:     # a block this walk does not know (a ``match`` case)
            return line


def _parent_of(tree: ast.AST, block: list) -> tuple[Optional[ast.AST], str]:
    """The statement whose ``body``, ``orelse`` or ``finalbody`` is ``block``, and which; an
    ``except`` clause's body answers as its ``try`` (``"handlers"``); ``(None, "")`` if none."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            if getattr(node, field, None) is block:
                if isinstance(node, ast.ExceptHandler):
                    return next(t for t in ast.walk(tree) if isinstance(t, ast.Try)
                                and node in t.handlers), "handlers"
                return node, field
    return None, ""


def debugger_line(step_id: str, frame: Any) -> int:
    """Where a debugger started by stop ``step_id`` in ``frame`` stops: the next line to run (the
    stop itself runs on its anchor's line, ``frame.f_lineno``). What the banner and the tour
    print, so that their ``file:line`` is pdb's."""
    return _resume.get((frame.f_code.co_filename, frame.f_lineno, step_id), frame.f_lineno)


def _block_of(tree: ast.AST, target: ast.stmt) -> tuple[list, int]:
    """The statement list holding ``target`` and its index there."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            for i, stmt in enumerate(block if isinstance(block, list) else ()):
                if stmt is target:
                    return block, i
    raise ValueError(f"no block holds the statement at line {target.lineno}")


def _code_of(func: Any, defn: ast.FunctionDef) -> Any:
    """Compile the function's edited definition; a method goes inside a class of its own class's
    name, so ``super()`` finds its ``__class__`` cell."""
    defn.decorator_list = []
    owner = func.__qualname__.split(".")[-2] if "." in func.__qualname__ else None
    body: ast.stmt = defn
    if owner:
        body = ast.copy_location(ast.ClassDef(name=owner, bases=[], keywords=[], body=[defn],
                                              decorator_list=[]), defn)
    module = compile(ast.fix_missing_locations(ast.Module(body=[body], type_ignores=[])),
                     func.__code__.co_filename, "exec")
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
    _restore()
    from minivllm.step_table import REGISTRY
    by_function: dict[Any, list[tuple[Any, str]]] = {}
    witnesses = tuple(w for i in _requested for w in REGISTRY[i].needs)
    for step_id in dict.fromkeys(_requested + witnesses):
        for func, anchor in sites(step_id):
            by_function.setdefault(func, []).append((REGISTRY[step_id], anchor))
    for func, stops in by_function.items():
        _original[func] = func.__code__
        func.__code__ = _compile_stops(func, stops)
    BREAKS.update(dict.fromkeys(_requested, True))
    _asked.update(dict.fromkeys(_requested))
    return _requested


def disarm() -> None:
    """Every function back to its own code; no id armed, and none of those asked so far named at
    exit (whoever disarms, a tour or a test, has had its stops)."""
    _restore()
    _asked.clear()


def _restore() -> None:
    BREAKS.clear()
    _resume.clear()
    for func, code in _original.items():
        func.__code__ = code
    _original.clear()


def at_step(step_id: str, when: Any = True) -> bool:
    """True (once per id and engine) when ``step_id`` is armed and ``when`` is truthy; then prints
    the step, where it is, the values to look at and why they are what they are."""
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
        print("\n".join(banner(current, sys._getframe(1))), file=sys.stderr)
    return True


def banner(step: Any, frame: Any) -> list[str]:
    """What a stop prints: the id, the article's sentence, ``file:line`` and function; the locals
    to look at (the step's ``show``); and the "why" lines of its note (``step_table.NOTES``), with
    no tokenizer, so ids stay ids. A note that fails is left out: the stop must never break the run."""
    lines = [f"minivllm step {step.id}: {step.article} "
             f"[{frame.f_code.co_filename}:{debugger_line(step.id, frame)} {step.function}]",
             f"  look at: {step.show}"]
    from minivllm.step_table import NOTES
    if step.id in NOTES:
        try:
            lines += ["  why: " + x for x in NOTES[step.id](frame, _NoTour())]
        except Exception as e:   # noqa: BLE001 (a note reads live values; never stop the engine)
            lines.append(f"  why: <{type(e).__name__}: {e}>")
    return lines


class _NoTour:
    """What a note reads of the tour, outside one: no tokenizer, no instance name."""
    tokenizer = None
    instance = ""


def never_fired() -> list[str]:
    """One line per requested id that never stopped in this process, with why, if known: the
    ``never_means`` of the first stop it needs (or of itself) that never came either."""
    from minivllm.step_table import REGISTRY
    lines = []
    for step_id in (i for i in _asked if i not in _seen):
        step = REGISTRY[step_id]
        why = next((f": {REGISTRY[w].never_means}" for w in step.needs + (step_id,)
                    if REGISTRY[w].never_means and w not in _seen), "")
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
