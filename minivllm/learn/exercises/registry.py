"""The course's exercises, one entry per article step, and the guard every check runs under.

Each check module declares its checks with ``@exercise(...)``: the name the student's cell defines,
the nbgrader assignment it belongs to, the article step it teaches, the package implementations a
solution may not call (``forbidden``), and the mistakes its hidden cases catch. The decorated
function is what a notebook's test cell calls::

    exercises.check_residual_distribution(residual_distribution, cases="visible")

``cases`` picks the check's case set: ``"visible"`` (the basic cases, in the student's copy),
``"hidden"`` (the cases that catch the common mistakes, between nbgrader's hidden-test markers in
the source notebook) or ``"all"``. A failed check raises ``ExerciseCheckError`` (nbgrader scores the
cell 0); a passed one prints one ``✓`` line on stdout, returns ``None`` and writes nothing on
stderr (nbgrader scores a cell with stderr output 0).
"""
from __future__ import annotations

import functools
import importlib
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

CASES = ("visible", "hidden", "all")


class ExerciseCheckError(AssertionError):
    """The student's function is unfinished, raised, or returned a wrong answer for a named case."""


@dataclass(frozen=True)
class Exercise:
    name: str                        # the function or class the student's cell defines
    assignment: str                  # nbgrader assignment: "spec_decode", "pd", "pd_at_scale"
    article_step: str                # the article's step (or "after the article") it teaches
    check: Callable[..., None]       # the undecorated check: check(fn, cases=...)
    forbidden: tuple[str, ...] = ()  # "module:Qual.name" a solution may not call
    mistakes: tuple[str, ...] = ()   # what the hidden cases catch, in a sentence each
    optional: bool = False
    run: Callable[..., None] = field(default=None, repr=False)   # the guarded check


EXERCISES: dict[str, Exercise] = {}
_CHECK_ENTRIES: set = set()   # the guarded checks' code: where the stack above a check begins


def exercise(*, name: str, assignment: str, article_step: str, forbidden: tuple[str, ...] = (),
             mistakes: tuple[str, ...] = (), optional: bool = False) -> Callable:
    """Register ``check(fn, cases)`` as exercise ``name``; returns the guarded check."""
    def register(check: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(check)
        def run(fn: Any, cases: str = "all") -> None:
            if cases not in CASES:
                raise ValueError(f"cases must be one of {CASES}, not {cases!r}")
            with no_forbidden_calls(name, fn, EXERCISES[name].forbidden):
                check(fn, cases=cases)

        _CHECK_ENTRIES.add(run.__code__)
        EXERCISES[name] = Exercise(name=name, assignment=assignment, article_step=article_step,
                                   check=check, forbidden=tuple(forbidden), mistakes=tuple(mistakes),
                                   optional=optional, run=run)
        return run
    return register


def student_files(fn: Any) -> set[str]:
    """The files the student's code was compiled from: a function's, or every method's of a class
    (a notebook cell is a file of its own to Python)."""
    codes = []
    if isinstance(fn, type):
        for value in vars(fn).values():
            value = getattr(value, "__func__", value)
            if hasattr(value, "__code__"):
                codes.append(value.__code__)
    elif hasattr(fn, "__code__"):
        codes.append(fn.__code__)
    return {c.co_filename for c in codes}


def _resolve(qualname: str) -> tuple[Any, str, Any]:
    """"pkg.module:Class.attr" -> (owner, attribute name, the attribute as stored on the owner)."""
    module, _, attrs = qualname.partition(":")
    owner: Any = importlib.import_module(module)
    *path, last = attrs.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, last, vars(owner)[last] if isinstance(owner, type) else getattr(owner, last)


@contextmanager
def no_forbidden_calls(name: str, fn: Any, forbidden: tuple[str, ...]) -> Iterator[None]:
    """While the check runs, each forbidden implementation raises ``ExerciseCheckError`` when the
    student's code is on the call stack (the check itself may still call it for the expected
    answer). A student who catches that error still fails: the call is remembered."""
    files = student_files(fn)
    caught: list[str] = []
    patched = []

    def guard(qualname: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            # Only the frames the check started count: its caller may share the student's
            # file (a test module that defines a function and checks it).
            frame = sys._getframe(1)
            while frame is not None and frame.f_code not in _CHECK_ENTRIES:
                if frame.f_code.co_filename in files:
                    caught.append(qualname)
                    raise ExerciseCheckError(
                        f"{name} calls {qualname.replace(':', '.')}, the package's own "
                        "implementation of this step: a solution writes the step itself, so "
                        "this exercise scores 0.")
                frame = frame.f_back
            return original(*args, **kwargs)
        return guarded

    try:
        for qualname in forbidden if files else ():
            owner, attr, stored = _resolve(qualname)
            original = stored.__func__ if isinstance(stored, (staticmethod, classmethod)) else stored
            wrapped = guard(qualname, original)
            if isinstance(stored, staticmethod):
                wrapped = staticmethod(wrapped)
            elif isinstance(stored, classmethod):
                wrapped = classmethod(wrapped)
            setattr(owner, attr, wrapped)
            patched.append((owner, attr, stored))
        yield
    finally:
        for owner, attr, stored in reversed(patched):
            setattr(owner, attr, stored)
    if caught:
        raise ExerciseCheckError(
            f"{name} calls {caught[0].replace(':', '.')}, the package's own implementation of "
            "this step: a solution writes the step itself, so this exercise scores 0.")
