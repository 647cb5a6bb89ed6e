"""The fresh process of the isolated grading (isolate.py starts it; nothing else imports this).
A learning aid of the course; vLLM has no counterpart.

It reads its job and a nonce on stdin, imports the checks, takes the integrity snapshot, runs the
student's kept definitions cell by cell (file ``<student>``) and each exercise's checks, compares
the snapshot after each exercise, and writes one line per exercise, ``<nonce> <json>``, on a
descriptor of its own: file descriptors 1 and 2 go to /dev/null and ``sys.stdout`` to a buffer
while the student's code runs. It imports nothing but the checks, to start fast (one process per
notebook, and one more after a time-out).
"""
from __future__ import annotations

import ast
import json
import os
import sys
from typing import Any

STUDENT_FILE = "<student>"
TEST_FILE = "<test>"
RESULT_MAX_CHARS = 20_000       # a longer message (a huge `got:`) is cut


class _Capped:
    """A text stream that keeps its first ``limit`` characters (a student's print loop is cut)."""

    def __init__(self, limit: int = 100_000) -> None:
        self.parts: list[str] = []
        self.size, self.limit = 0, limit

    def write(self, text: str) -> int:
        if self.size < self.limit:
            self.parts.append(text[:self.limit - self.size])
            self.size += len(self.parts[-1])
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def getvalue(self) -> str:
        return "".join(self.parts)


def _protected_modules(name: str) -> bool:
    return (name == "minivllm" or name.startswith("minivllm.")
            or name in ("torch", "numpy", "builtins", "math"))


def _dispatch_table(value: Any) -> bool:
    """A registry: a dict of checks (``CHECKS``) or of exercises (``registry.EXERCISES``). The
    checks' data (their cases, the connector's store, caches) changes as they run: not compared."""
    return isinstance(value, dict) and bool(value) and all(
        callable(v) or callable(getattr(v, "run", None)) for v in value.values())


def _take_snapshot(modules: dict, tables_prefix: str = "minivllm.learn.exercises") -> dict:
    """{dotted name: what it held} for everything the integrity check protects."""
    snap: dict[str, Any] = {}
    for modname, module in list(modules.items()):
        if module is None or not _protected_modules(modname) or modname == "__main__":
            continue
        for attr, value in list(vars(module).items()):
            key = f"{modname}.{attr}"
            if isinstance(value, type) or callable(value):
                snap[key] = value
                if isinstance(value, type) and getattr(value, "__module__", "") == modname \
                        and modname.startswith("minivllm"):
                    for member, v in list(vars(value).items()):
                        if callable(v) or isinstance(v, (staticmethod, classmethod, property)):
                            snap[f"{key}.{member}"] = v
            elif modname.startswith(tables_prefix) and _dispatch_table(value):
                snap[key + "[...]"] = ("table", tuple(value.items()))
    torch = modules.get("torch")
    if torch is not None:
        for member, v in list(vars(torch.Tensor).items()):
            if callable(v) or isinstance(v, (staticmethod, classmethod, property)):
                snap[f"torch.Tensor.{member}"] = v
    return snap


def _library_wrapper(new: Any, old: Any) -> bool:
    """A wrapper a library put around its own function when a module of it loaded (importing
    ``torch._dynamo`` wraps ``torch.manual_seed``): it wraps the original, and its code lives in
    that library's files."""
    inner = new
    for _ in range(8):
        inner = getattr(inner, "__wrapped__", None)
        if inner is None:
            return False
        if inner is old:
            break
    else:
        return False
    top = (getattr(new, "__module__", None) or "").split(".")[0]
    package = sys.modules.get(top) if top in ("torch", "numpy") else None
    root = os.path.dirname(os.path.abspath(package.__file__)) if package else ""
    code = getattr(new, "__code__", None)
    return bool(root and code and os.path.abspath(code.co_filename).startswith(root + os.sep))


def _changes(before: dict, after: dict) -> list[str]:
    changed = []
    for key, value in before.items():
        if key not in after:
            changed.append(key)
            continue
        new = after[key]
        if new is not value and _library_wrapper(new, value):
            continue
        if isinstance(value, tuple) and value[:1] == ("table",):
            old_items, new_items = value[1], new[1] if isinstance(new, tuple) else None
            if new_items is None or len(old_items) != len(new_items) or any(
                    a is not b and not (isinstance(a, tuple) and isinstance(b, tuple)
                                        and len(a) == len(b)
                                        and all(x is y for x, y in zip(a, b)))
                    for a, b in zip(old_items, new_items)):
                changed.append(key)
        elif new is not value:
            changed.append(key)
    return changed


def _import_checks(names: list[str]) -> None:
    """Import the modules that register the checks (``minivllm.learn.exercises`` imports every
    check module, as the notebooks' ``exercises.check_<name>`` needs)."""
    import importlib
    for name in names:
        importlib.import_module(name)


def _run_statements(statements: list[dict], ns: dict) -> list[str]:
    """Run the student's kept statements; returns what raised (the cell raised there too)."""
    errors = []
    for st in statements:
        try:
            module = ast.parse(st["source"])
            ast.increment_lineno(module, st["line"] - 1)
            exec(compile(module, STUDENT_FILE, "exec"), ns)
        except BaseException as e:      # noqa: BLE001 (a student's SystemExit too)
            errors.append(f"line {st['line']}: {type(e).__name__}: {e}")
    return errors


def child_main() -> None:
    """The fresh process: read the job, import the checks, snapshot, then grade each exercise."""
    job = json.loads(sys.stdin.read())
    sys.stdin.close()
    nonce = job["nonce"]
    out_fd = os.dup(1)                          # results go here, prefixed with the nonce
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)                         # a student's os.write(1, ...) goes nowhere
    os.dup2(devnull, 2)

    def emit(payload: dict) -> None:
        for key in ("message", "stdout"):
            if len(payload.get(key, "")) > RESULT_MAX_CHARS:
                payload[key] = payload[key][:RESULT_MAX_CHARS] + " ..."
        os.write(out_fd, (nonce + " " + json.dumps(payload) + "\n").encode())

    import warnings
    warnings.simplefilter("ignore")
    _import_checks(job["check_modules"])
    from minivllm.learn.exercises import registry
    checks = {ex.run.__name__: ex for ex in registry.EXERCISES.values()}
    for ex in checks.values():                  # the implementations a solution may not call
        for qualname in ex.forbidden:
            registry._resolve(qualname)
    guard, check_error = registry.no_forbidden_calls, registry.ExerciseCheckError
    modules = sys.modules
    take, diff = _take_snapshot, _changes
    before = take(modules)
    sys.path.append(os.getcwd())                # the student's own helper modules, last
    emit({"ready": True})

    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    cells = list(job["cells"])
    define_errors: list[str] = []
    for exercise in job["exercises"]:
        captured = _Capped()
        sys.stdout, sys.stderr = captured, _Capped(1000)
        while cells and cells[0]["index"] < exercise["cell"]:
            define_errors += _run_statements(cells.pop(0)["statements"], ns)
        result = {"grade_id": exercise["grade_id"], "passed": True}
        for op in exercise["ops"]:
            try:
                if "exec" in op:
                    source = "\n" * (op["line"] - 1) + op["exec"]
                    exec(compile(source, TEST_FILE, "exec"), ns)
                    continue
                ex = checks.get(op["check"])
                if ex is None:
                    raise LookupError(f"no registered check named {op['check']} (known: "
                                      f"{', '.join(sorted(checks))})")
                try:
                    fn = eval(compile(op["arg"], TEST_FILE, "eval"), ns)
                except NameError:
                    raise check_error(
                        f"{op['arg']} is not defined: no cell defines it (a cell that defines it "
                        "must run before this one)") from None
                with guard(ex.name, fn, ex.forbidden):
                    ex.check(fn, cases=op["cases"])
            except BaseException as e:  # noqa: BLE001 (a student's SystemExit, KeyboardInterrupt)
                message = str(e) or type(e).__name__
                if define_errors and not isinstance(e, check_error):
                    message += ("\n  while defining your cells: " + "; ".join(define_errors[-3:]))
                result = {"grade_id": exercise["grade_id"], "passed": False,
                          "ename": type(e).__name__, "message": message}
                break
        changed = diff(before, take(modules))
        if changed:
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more"
                                              if len(changed) > 3 else "")
            result = {"grade_id": exercise["grade_id"], "passed": False,
                      "ename": "ExerciseCheckError",
                      "message": f"your code changed {shown}: a solution may not change the "
                                 "checks, so this exercise scores 0."}
        if result["passed"]:
            result["stdout"] = "".join(line for line in captured.getvalue().splitlines(True)
                                       if line.startswith("\u2713"))
        emit(result)
    os._exit(0)                                 # no atexit hook of the student's runs
