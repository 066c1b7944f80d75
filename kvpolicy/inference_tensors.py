"""Held state made under ``torch.inference_mode()`` turned into ordinary tensors before a step outside it.

A tensor created inside ``torch.inference_mode()`` is an *inference tensor*: outside that mode torch refuses to
update it in place ("Inplace update to inference tensor outside InferenceMode") and to save it for autograd
("Inference tensors cannot be saved for backward"). A cache filled inside the mode (``chunked_prefill`` runs in
it, so does a user's ``with torch.inference_mode():`` prefill) holds such tensors in every part that allocated
state there: the segments, the stores and their staging, centres, fits and coefficient tables, the policies'
states (H2O's scores), the shared positions. :func:`normalize` replaces each of them, once, before the first
step outside the mode, by an ordinary tensor over the same storage (no copy: the same bytes, offset, shape and
strides), so views and tensors held in several places (positions shared between layers) stay shared. Tensor
subclasses of other libraries (quanto's, hqq's) are left as they are: their backends do not update them in place.
"""

from __future__ import annotations

import types
from typing import Any

import torch


def normalize(*roots: Any) -> int:
    """Replace every inference tensor reachable from ``roots`` by an ordinary tensor over the same storage (in
    place, where it is held).

    Reachable: attributes of objects with a ``__dict__`` (frozen dataclasses included), items of lists and dicts,
    and tuples (rebuilt). Modules (Python's and ``torch.nn.Module``), classes, functions and weak references are
    not entered. A tensor reached several times is replaced once and every holder gets the same replacement.

    Parameters
    ----------
    *roots
        The objects holding the state (a cache's layer engines and its position book).

    Returns
    -------
    int
        The number of tensors replaced.
    """
    copies: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    for root in roots:
        _visit(root, copies, seen)
    return len(copies)


def _fixed(value: Any, copies: dict[int, torch.Tensor], seen: set[int]) -> Any:
    """``value`` with its inference tensors replaced (the same object when nothing inside it changed identity)."""
    if isinstance(value, torch.Tensor):
        if not value.is_inference() or type(value) not in (torch.Tensor, torch.nn.Parameter):
            return value
        if id(value) not in copies:
            with torch.inference_mode(False):
                alias = torch.empty(0, dtype=value.dtype, device=value.device)
                copies[id(value)] = alias.set_(value.untyped_storage(), value.storage_offset(), value.size(),
                                               value.stride())  # fmt: skip
        return copies[id(value)]
    if isinstance(value, tuple):
        items = [_fixed(item, copies, seen) for item in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # a named tuple keeps its type
    _visit(value, copies, seen)
    return value


def _visit(obj: Any, copies: dict[int, torch.Tensor], seen: set[int]) -> None:
    """Fix the tensors held inside ``obj`` (a container or an object with attributes)."""
    if obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype, torch.device)):
        return
    if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, torch.nn.Module)):
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            obj[i] = _fixed(item, copies, seen)
    elif isinstance(obj, dict):
        for key, item in list(obj.items()):
            obj[key] = _fixed(item, copies, seen)
    elif hasattr(obj, "__dict__"):
        for name, item in list(vars(obj).items()):
            fixed = _fixed(item, copies, seen)
            if fixed is not item:
                object.__setattr__(obj, name, fixed)  # frozen dataclasses too (a cached tensor they hold)
