"""A linear weight kept only in a route's prepared layout, yet readable as the plain matrix.

vLLM's CPU build packs each linear weight once for oneDNN and then drops the plain one
(vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``
sets ``layer.weight`` to an empty tensor), so the model is in memory once. minivllm does the same,
but ``layer.weight`` must stay readable: the heads' training reads the target's ``lm_head``, a
self-draft model shares the target's ``state_dict()``, notebooks and tests compare weights. So the
packed copy becomes the layer's parameter, wrapped in :class:`PackedWeight`, a tensor subclass (the
pattern of torchao's packed weights and torchtune's ``NF4Tensor``):

- ``F.linear(x, w)`` (the layer's method, or a module that shares the weight) runs the route on
  the packed form, as the layer did before;
- every other torch op sees the plain ``[out, in]`` matrix, unpacked for that op and dropped
  after it (``torch.equal``, indexing, ``@``, printing, ``torch.save``): exact, but each read
  costs a reorder of the whole matrix;
- an in-place write (``copy_``, ``mul_``, ``w[i] = ...``, ``w.data.copy_``, an optimizer step,
  also through a view such as ``w.narrow(...)``) unpacks, writes and packs again;
- the aliases ``detach()``, ``.data`` and ``state_dict()`` make share the packed copy.

Not supported: changing its dtype or device in place (``module.to(torch.bfloat16)`` after
loading raises; assign a plain tensor to the parameter instead), and raw memory access
(``data_ptr``, safetensors' ``save_file``): ``.dense()`` gives the plain matrix for those.
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from minivllm.model_executor.kernel_choice import CANDIDATES, PREPARE, UNPACK

_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
_SET_DATA = torch.Tensor.data.__set__   # a new method-wrapper per lookup: compare with ==


class _Packed:
    """The one packed copy (``PREPARE[route](plain)``), shared by a weight and its aliases."""
    __slots__ = ("route", "packed")

    def __init__(self, route: str, packed: torch.Tensor) -> None:
        self.route, self.packed = route, packed

    def dense(self) -> torch.Tensor:
        return UNPACK[self.route](self.packed)

    def repack(self, plain: torch.Tensor) -> None:
        with torch.no_grad():
            self.packed = PREPARE[self.route](plain.detach())


class PackedWeight(torch.Tensor):
    """``[out, in]`` (or a view of it: ``_views`` are replayed on the unpacked matrix); the
    storage is ``_box.packed``, an opaque tensor in the route's layout."""
    _box: _Packed
    _views: tuple

    @staticmethod
    def __new__(cls, box: _Packed, like: torch.Tensor, views: tuple = (),
                requires_grad: bool = False) -> "PackedWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device,
            requires_grad=requires_grad)

    def __init__(self, box: _Packed, like: torch.Tensor, views: tuple = (),
                 requires_grad: bool = False) -> None:
        self._box, self._views = box, views

    @classmethod
    def pack(cls, weight: torch.Tensor, route: str,
             packed: Optional[torch.Tensor] = None) -> "PackedWeight":
        """``weight [out, in]`` -> a parameter holding only ``packed`` (``PREPARE[route](weight)``,
        made here when not given), with ``weight``'s ``requires_grad``."""
        if packed is None:
            with torch.no_grad():
                packed = PREPARE[route](weight.detach())
        return torch.nn.Parameter(cls(_Packed(route, packed), weight),
                                  requires_grad=weight.requires_grad)

    @property
    def route(self) -> str:
        return self._box.route

    def dense(self) -> torch.Tensor:
        """The plain tensor this stands for (a new one on every call)."""
        out = self._box.dense()
        for func, args, kwargs in self._views:
            out = func(out, *args, **kwargs)
        return out

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``F.linear(x, self, bias)``: ``x [..., in]`` -> ``[..., out]`` by the route on the
        packed copy; through the plain matrix where the route cannot serve (another device, an
        empty input, autograd: the route has no backward)."""
        if (self._views or x.device.type != "cpu" or x.numel() == 0 or type(x) is not torch.Tensor
                or torch.is_grad_enabled() and (self.requires_grad or x.requires_grad or (
                    bias is not None and bias.requires_grad))):
            with torch._C.DisableTorchFunctionSubclass():
                return F.linear(x, self, bias)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out = CANDIDATES[self._box.route](x2, self._box.packed)
        if bias is not None:
            out = out + bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"PackedWeight(route={self.route!r}, plain={self.dense()!r})"

    def numpy(self, *, force: bool = False):
        return self.dense().numpy(force=force)

    def __reduce_ex__(self, protocol):
        # pickle / torch.save store the plain matrix (a parameter stays a parameter).
        if getattr(self, "_is_param", False):
            return torch._utils._rebuild_parameter, (self.dense(), self.requires_grad, OrderedDict())
        return self.dense().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        # A deep copy is plain: the copied layer packs again if it is processed again.
        out = self.dense().clone()
        if getattr(self, "_is_param", False):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and type(args[1]) is cls:
            return args[1].linear(args[0], args[2] if len(args) > 2 else kwargs.get("bias"))
        if func == _SET_DATA:   # ``w.data = v``: what module.to(...) does to each parameter
            self, value = args
            if type(value) is cls and value._box is self._box and not value._views:
                return None       # a no-op conversion (to the dtype and device it has)
            if (value.shape, value.dtype, value.device) != (self.shape, self.dtype, self.device):
                raise TypeError("a PackedWeight cannot change its shape, dtype or device in "
                                "place (module.to(...) after loading): assign a plain tensor "
                                "to the parameter instead")
            self._box.repack(value.dense() if type(value) is cls else value)
            return None
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if type(first) is cls and (func in _ALIASES or func.is_view):
            # An alias or a view shares the packed copy: a write through it reaches the weight.
            views = first._views if func in _ALIASES else \
                first._views + ((func, args[1:], kwargs),)
            like = func(first.dense(), *args[1:], **kwargs) if func.is_view else first
            return cls(first._box, like, views)
        written: list[tuple[_Packed, torch.Tensor]] = []   # (box, its unpacked full matrix)
        write_args = {a.name for a in func._schema.arguments
                      if a.alias_info is not None and a.alias_info.is_write}
        names = [a.name for a in func._schema.arguments]

        def unwrap(t: Any, name: Optional[str] = None) -> Any:
            if type(t) is not cls:
                return t
            if name not in write_args:
                return t.dense()
            full = t._box.dense()
            written.append((t._box, full))
            view = full
            for f, a, k in t._views:   # the same view of the full matrix, written in place
                view = f(view, *a, **k)
            return view

        new_args = [unwrap(a, names[i] if i < len(names) else None) for i, a in enumerate(args)]
        new_kwargs = {k: unwrap(v, k) if type(v) is cls else tree_map(unwrap, v)
                      for k, v in kwargs.items()}
        new_args = [tree_map(unwrap, a) if isinstance(a, (list, tuple)) else a for a in new_args]
        out = func(*new_args, **new_kwargs)
        for box, full in written:
            box.repack(full)
        if written:   # an in-place or out= op returns the tensor it wrote: give back the wrapper
            if func._schema.name.endswith("_") and type(first) is cls:
                return first
            if type(kwargs.get("out")) is cls:
                return kwargs["out"]
        return out


def pack_layers(model: torch.nn.Module, jobs: list[tuple[list, list, str, Optional[list]]]) -> int:
    """Per job ``(holders, weights, route, copies)`` (one shape), make ``weights[j]`` a
    ``PackedWeight`` in every layer of ``holders[j]``, from the timing's ``copies[j]`` if given;
    -> how many were packed. A weight another module of ``model`` also reads (an embedding tied to
    the LM head) stays plain, and so does one oneDNN cannot pack. Plain tensors are freed in the
    loop, weight by weight; their memory goes back to the OS once, at the end."""
    owners: dict[int, list[int]] = {}   # parameter -> the modules holding it
    for mod in model.modules():
        for p in mod._parameters.values():
            owners.setdefault(id(p), []).append(id(mod))
    packed = 0
    for holders, weights, route, copies in jobs:
        for j, w in enumerate(weights):
            if set(owners.get(id(w), ())) - {id(mod) for mod in holders[j]}:
                continue
            try:
                param = PackedWeight.pack(w, route, copies[j] if copies else None)
            except RuntimeError:
                continue
            for mod in holders[j]:
                mod.weight = param
            weights[j] = w = param
            if copies:
                copies[j] = None
            packed += 1
    _return_freed_memory()
    return packed


def _return_freed_memory() -> None:
    """Hand the freed plain weights' pages back to the OS. glibc keeps freed heap memory for
    reuse; measured on float32 SmolLM2 that was ~80 MB of resident memory after load (1,034 MB
    against 955 MB with ``malloc_trim``, the same as ``F.linear`` alone). A no-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
