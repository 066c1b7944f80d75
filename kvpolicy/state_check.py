"""Checks of a restored state (a saved cache's layers, stores, blocks and policy states).

A saved cache is untrusted input: whoever wrote the file also wrote its checksums. Every
``load_state_dict`` of kvpolicy's parts checks what it is given with these functions before it
keeps it, so that a restored part is one its own code could have built: the keys it expects and no
others, integers in range, tensors of the dtype and shape the layer's tensors imply, positions that
are unique and in range. Each raises ``ValueError`` naming what is wrong; the loader
(:mod:`kvpolicy.cache_io`) turns it into a :class:`~kvpolicy.errors.CacheFileError` naming the file
and the layer. Plain torch: no transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kvpolicy.errors import CacheFileError

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: Any, what: str = "dtype") -> torch.dtype:
    """The dtype named ``name``, one of the dtypes a saved cache may hold: every dtype name read from a file
    (a tensor reference, a store's or a block's state, the model identity) or from a configuration becomes a
    dtype here, through this allowlist, never by a look-up on ``torch``.

    Raises
    ------
    CacheFileError
        If ``name`` is not one of the allowed names (the message names them).
    """
    if not isinstance(name, str) or name not in _DTYPES:
        raise CacheFileError(
            f"{what}={name!r:.40} is not a dtype a saved cache holds; expected one of {sorted(_DTYPES)}"
        )
    return _DTYPES[name]


def entries(state: Any, what: str, required: Iterable[str], optional: Iterable[str] = ()) -> Mapping[str, Any]:
    """``state``, checked to be a mapping holding every ``required`` key and nothing but those and ``optional``."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{what}: expected a mapping of saved entries; got a {type(state).__name__}")
    required, optional = set(required), set(optional)
    missing, unknown = sorted(required - set(state)), sorted(set(state) - required - optional)
    if missing or unknown:
        parts = [f"missing {missing}" if missing else "", f"unexpected {unknown}" if unknown else ""]
        raise ValueError(f"{what}: {', '.join(p for p in parts if p)} (expected {sorted(required | optional)})")
    return state


def integer(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    """``value``, checked to be an ``int`` (not a bool) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}: expected an integer; got {type(value).__name__} {value!r:.40}")
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{what}={value} is out of range (expected {bound})")
    return value


def flag(value: Any, what: str) -> bool:
    """``value``, checked to be a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{what}: expected true or false; got {type(value).__name__} {value!r:.40}")
    return value


def choice(value: Any, what: str, allowed: Iterable[Any]) -> Any:
    """``value``, checked to be one of ``allowed``."""
    allowed = list(allowed)
    if isinstance(value, (dict, list)) or value not in allowed:
        raise ValueError(f"{what}={value!r:.40} is not one of {allowed}")
    return value


def tensor(
    value: Any, what: str, dtype: torch.dtype | Iterable[torch.dtype] | None = None,
    shape: Iterable[int | None] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``value``, checked to be a tensor of ``dtype`` (one of them, if several) and ``shape``
    (``None`` entries: any size)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{what}: expected a tensor; got {type(value).__name__} {value!r:.40}")
    if dtype is not None:
        dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if value.dtype not in dtypes:
            names = [str(d).removeprefix("torch.") for d in dtypes]
            raise ValueError(f"{what}: dtype {str(value.dtype).removeprefix('torch.')}, expected {' or '.join(names)}")
    if shape is not None:
        want = tuple(shape)
        got = tuple(value.shape)
        if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want, strict=False)):
            shown = tuple("*" if w is None else w for w in want)
            raise ValueError(f"{what}: shape {got}, expected {shown}")
    return value


def finite(value: torch.Tensor, what: str) -> torch.Tensor:
    """``value`` (a floating tensor), checked to hold no NaN or Inf."""
    if value.is_floating_point() and value.numel() and not bool(torch.isfinite(value).all()):
        raise ValueError(f"{what}: holds NaN or Inf values")
    return value


def positions(value: torch.Tensor, what: str, length: int) -> torch.Tensor:
    """``value`` (``(rows, n)`` integers), checked to hold, in each row, distinct positions in ``[0, length)``."""
    if value.dim() != 2:
        raise ValueError(f"{what}: expected (rows, n) positions; got shape {tuple(value.shape)}")
    if value.numel():
        lo, hi = int(value.min()), int(value.max())
        if lo < 0 or hi >= length:
            raise ValueError(f"{what}: positions reach {lo if lo < 0 else hi}, outside [0, {length})")
        ordered = torch.sort(value.long(), dim=1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise ValueError(f"{what}: a position is held twice")
    return value


#: the dtypes of a cache's floating tensors (full-precision tokens, what blocks dequantize to), by name
FLOAT_DTYPES = {name: dtype_of(name) for name in ("float16", "bfloat16", "float32")}


def float_dtype(name: Any, what: str) -> torch.dtype:
    """The dtype a saved ``name`` gives, one of :data:`FLOAT_DTYPES` (through :func:`dtype_of`, never looked up
    on ``torch``)."""
    return dtype_of(choice(name, what, FLOAT_DTYPES), what)


def shape4(shape: Any, what: str) -> tuple[int, int, int, int]:
    """A saved ``[batch, kv_heads, tokens, head_dim]``, checked."""
    if not isinstance(shape, list) or len(shape) != 4:
        raise ValueError(f"{what} {shape!r:.40} is not [batch, kv_heads, tokens, head_dim]")
    b, h, n, d = (integer(x, what, 0) for x in shape)
    return b, h, n, d


def layer_tokens(keys: Any, values: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's saved full-precision ``keys`` and ``values``: ``(batch, kv_heads, n, head_dim)``
    tensors of one of :data:`FLOAT_DTYPES`, the same dtype and the same first three sizes."""
    keys = tensor(keys, "keys", tuple(FLOAT_DTYPES.values()))
    values = tensor(values, "values", keys.dtype)
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} are not one layer's tokens")
    return keys, values
