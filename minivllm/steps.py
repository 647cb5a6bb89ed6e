"""Article-step breakpoints: a stable id for every numbered step of the article ("Inside vLLM",
part 3), and the one line in the engine where that step's values sit in local variables.

Each engine function that implements a step carries one line::

    if BREAKS and at_step("spec.4", request.spec_token_ids): breakpoint()

``BREAKS`` is a dict, empty unless someone asked for breakpoints, so switched off a step costs one
dictionary lookup. Switched on, ``at_step`` says whether to stop (the id was asked for, its condition
holds, and it has not stopped yet in this engine: each id stops once per ``LLM``), prints one line
naming the step, and the engine calls the builtin ``breakpoint()`` in its own frame, so
``PYTHONBREAKPOINT`` picks the debugger (pdb, ipdb, pudb, VS Code's debugpy; ``0`` disables).

Ask with ``MINIVLLM_BREAK=spec.4,pd.lookup`` (or ``all``, or a group ``spec`` / ``pd``) or
``LLM(..., break_at=["spec.4"])``. ``python -m minivllm.tour spec|pd`` walks them in order.
The ids and what each shows are in ``step_table.py``, read only once someone asks for a step
(``steps.REGISTRY``, ``steps.STEPS``, ``steps.GROUPS`` and ``steps.Step`` load it).
"""
from __future__ import annotations

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

# id -> True for every requested id that has not stopped yet. Mutated in place, never rebound: the
# engine files import this very dict.
BREAKS: dict[str, bool] = {}
_requested: tuple[str, ...] = ()
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


def configure(break_at: "str | Iterable[str] | None" = None) -> tuple[str, ...]:
    """Arm the breakpoints for a new engine: ``break_at`` if given, else ``$MINIVLLM_BREAK``.
    Called by ``LLM.__init__`` before anything is built. Returns the armed ids."""
    global _requested
    source = break_at if break_at is not None else os.environ.get("MINIVLLM_BREAK")
    _requested = parse(source)
    BREAKS.clear()
    BREAKS.update(dict.fromkeys(_requested, True))
    return _requested


def disarm() -> None:
    BREAKS.clear()


def at_step(step_id: str, when: Any = True) -> bool:
    """True (once per id and engine) when ``step_id`` is armed and ``when`` is truthy."""
    global current
    if not BREAKS.get(step_id) or not when:
        return False
    del BREAKS[step_id]
    from minivllm.step_table import REGISTRY
    current = REGISTRY[step_id]
    if not quiet:
        caller = sys._getframe(1)
        print(f"minivllm step {step_id}: {current.article} "
              f"[{caller.f_code.co_filename}:{caller.f_lineno} {current.function}]", file=sys.stderr)
    return True


try:   # arm from the environment at import, so engines built without LLM(...) honour it too
    configure()
except ValueError as _e:     # reported again, as an exception, by LLM(...)
    print(f"minivllm: {_e}", file=sys.stderr)
