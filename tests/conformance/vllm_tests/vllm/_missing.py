"""vLLM names minivllm does not have. vLLM's test modules import many of them at the top (LoRA,
multimodal inputs, hybrid KV-cache specs, other connectors, ...); so that a module still imports and
its other tests run, such a name resolves to a stand-in class that raises ``NotInMinivllm`` (naming
the vLLM object) as soon as a test calls it. A test that needs it fails with that error, and the
table in ``expected_failures.py`` names the missing feature.

- ``MissingFinder``: ``import vllm.x.y`` for a module the adapter does not have gives a module whose
  every attribute is such a stand-in.
- ``module_getattr(name)``: the ``__getattr__`` of an adapter module, for the names it lacks.
- Called while pytest collects (a module's ``parametrize`` lists, its constants), a stand-in
  returns an inert placeholder instead of raising, so the module's other tests are still
  collected; using the placeholder raises. The plugin sets ``COLLECTING``.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


COLLECTING = False


class NotInMinivllm(Exception):
    """A vLLM object minivllm does not mirror."""


def _raise(name: str):
    raise NotInMinivllm(f"{name} is not in minivllm")


class _Placeholder:
    """What a stand-in returns when called during collection. It passes for a dataclass instance
    (``dataclasses.replace`` on it gives another placeholder)."""
    __dataclass_fields__: dict = {}

    def __init__(self, name: str = "a vLLM object", **_ignored) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        _raise(object.__getattribute__(self, "_name"))

    def __call__(self, *args, **kwargs):
        _raise(self._name)

    def __repr__(self) -> str:
        return f"<{self._name}: not in minivllm>"

    def __eq__(self, other):
        return self is other

    __hash__ = object.__hash__


class _MissingMeta(type):
    def __call__(cls, *args, **kwargs):
        if COLLECTING:
            return _Placeholder(cls._vllm_name)
        _raise(cls._vllm_name)

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return missing(f"{cls._vllm_name}.{attr}")

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        _raise(cls._vllm_name)

    def __repr__(cls) -> str:
        return f"<{cls._vllm_name}: not in minivllm>"


_CACHE: dict[str, type] = {}


def missing(name: str) -> type:
    """The stand-in for the vLLM object ``name`` (one per name)."""
    if name not in _CACHE:
        _CACHE[name] = _MissingMeta(name.rpartition(".")[2], (), {"_vllm_name": name})
    return _CACHE[name]


class _MissingModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return missing(f"{self.__name__}.{attr}")


class _MissingLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _MissingModule(spec.name)
        module.__path__ = []          # a package: its submodules are missing too
        return module

    def exec_module(self, module):
        pass


class MissingFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: ``vllm.*`` modules the adapter package has no file for."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("vllm."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _MissingLoader(), is_package=True)


def install() -> None:
    if not any(isinstance(f, MissingFinder) for f in sys.meta_path):
        sys.meta_path.append(MissingFinder())


def module_getattr(module_name: str):
    """``__getattr__`` for an adapter module: a submodule file of a package if there is one (so
    ``from vllm.v1 import core`` imports it), else the stand-in."""
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        module = sys.modules[module_name]
        if hasattr(module, "__path__") and importlib.machinery.PathFinder.find_spec(
                f"{module_name}.{attr}", module.__path__) is not None:
            return importlib.import_module(f"{module_name}.{attr}")
        return missing(f"{module_name}.{attr}")
    return __getattr__
