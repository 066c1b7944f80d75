"""A demoted-token store held in a transform's basis (the stage between policy and action)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from kvpolicy import state_check
from kvpolicy.actions.base import Action, DemotedStore
from kvpolicy.errors import MetadataOverflowError, NonFiniteError
from kvpolicy.layer.parts import Part
from kvpolicy.transforms.base import Transform

#: model dtypes whose range a rotated coordinate can exceed, and the dtype their rotated tokens are
#: held in instead. A coordinate mixes every channel of its block, so it can reach ``√B`` times the
#: block's largest magnitude (float16: finite keys of 30000 in a block of 64 can give 240000).
#: bfloat16 has float32's range and keeps its own dtype.
HELD_DTYPE = {torch.float16: torch.float32}


def cast_clamped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, finite values beyond ``dtype``'s range clamped to its largest finite value.

    For a reconstruction computed wider than the model's dtype (an un-rotation in float32): the
    original tokens were finite in ``dtype``, so a value just beyond its range is quantization error
    past the edge, and clamping moves it towards the original. NaN and ±Inf stay as they are.

    Parameters
    ----------
    x : torch.Tensor
        Any shape, floating point.
    dtype : torch.dtype
        The floating-point dtype to return.

    Returns
    -------
    torch.Tensor
        ``x``'s shape, in ``dtype`` (``x`` itself when it is in ``dtype`` already).
    """
    if x.dtype == dtype:
        return x
    top = torch.finfo(dtype).max
    if torch.finfo(x.dtype).max > top:
        x = torch.where(torch.isinf(x), x, x.clamp(-top, top))
    return x.to(dtype)


def wrap(store: DemotedStore, transform: Transform, action: Action) -> DemotedStore:
    """``store`` behind ``transform``; the store itself when there is nothing to transform (the
    identity, or an action that keeps no demoted tokens)."""
    if transform.identity or not action.keeps_demoted:
        return store
    own = getattr(transform, "wrap_store", None)  # a transform that holds state of its own per store
    return TransformedStore(store, transform) if own is None else own(store)


class TransformedStore(DemotedStore):
    """Forwards demoted tokens to the action's store in the transform's basis.

    ``add`` stores ``forward(keys)`` and ``forward(values)``, handed to the action in
    :data:`HELD_DTYPE` where the model's dtype could not hold them (float16 tokens: float32, whose
    ``meta_dtype="auto"`` metadata is float16 on the torch, cpu and triton backends, as for float16
    input); ``keys()``/``values()`` come back through ``inverse`` in the model's dtype (the
    materialised path). ``parts()`` (the fused path) stays in the transformed basis, which
    :attr:`basis` names: the reader rotates its query with ``forward`` and maps the attention output
    back with ``inverse`` (:func:`kvpolicy.fused.attend_parts`).
    Everything else (bytes, batch operations, staged positions) is the inner store's, through the
    methods :class:`~kvpolicy.actions.base.DemotedStore` declares; the action's own inspection
    attributes (streams, tiers) are reached through :attr:`inner`.
    """

    def __init__(self, inner: DemotedStore, transform: Transform) -> None:
        self.inner = inner
        self.transform = transform
        self._dims: tuple[int, int] | None = None  # (key head_dim, value head_dim), from the first add
        self._device: torch.device | None = None
        self._dtype: torch.dtype | None = None  # the model's dtype, from the first add

    @property
    def basis(self) -> Transform:  # type: ignore[override]
        return self.transform

    @property
    def positions(self) -> torch.Tensor:  # type: ignore[override]
        return self.inner.positions

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        self.inner.positions = value

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate ``keys`` and ``values`` ``(batch, kv_heads, n, head_dim)`` and store them.

        Raises
        ------
        NonFiniteError
            If finite tokens leave the rotation non-finite (beyond the range of float32, or of
            bfloat16): the message names the rotation, not the input.
        MetadataOverflowError
            If the action's metadata dtype cannot hold the rotated tokens' groups (its message names
            the remedy, and the rotation).
        """
        wide = HELD_DTYPE.get(keys.dtype, keys.dtype)
        rotated = self._forward_keys(keys.to(wide)), self.transform.forward(values.to(wide))
        try:
            self.inner.add(*rotated, positions)
        except MetadataOverflowError as exc:
            raise MetadataOverflowError(
                f"{exc} (These were {_name(keys.dtype)} tokens rotated by {self.transform!r}, held in "
                f"{_name(wide)}: a rotated coordinate mixes every channel of its block, so its magnitude can "
                "exceed the largest of the tokens' own.)"
            ) from None
        except NonFiniteError:
            if not (bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())):
                raise  # the input itself was not finite: the action's message is right
            for what, original, out in (("keys", keys, rotated[0]), ("values", values, rotated[1])):
                if not bool(torch.isfinite(out).all()):
                    amax = float(original.detach().abs().amax())
                    raise NonFiniteError(
                        f"{self.transform!r} turned finite {_name(original.dtype)} {what} (largest |value| {amax:.4g}) "
                        f"into non-finite ones: a rotated coordinate mixes every channel of its block and exceeded "
                        f"the range of {_name(out.dtype)} ({torch.finfo(out.dtype).max:.4g}). Scale the model's "
                        "activations down, or use transform='none' for this model."
                    ) from None
            raise
        if self._dims is None:
            self._dims, self._device = (keys.shape[-1], values.shape[-1]), keys.device
        self._dtype = keys.dtype

    def _forward_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Demoted keys ``(batch, kv_heads, n, head_dim)`` in the basis they are stored in."""
        return self.transform.forward(keys)

    def keys(self) -> torch.Tensor:
        return self._back(self.inner.keys())

    def values(self) -> torch.Tensor:
        return self._back(self.inner.values())

    def _back(self, y: torch.Tensor) -> torch.Tensor:
        """``inverse(y)`` in the model's dtype; ``y`` ``(batch, kv_heads, n, head_dim)`` rotated."""
        return cast_clamped(self.transform.inverse(y), y.dtype if self._dtype is None else self._dtype)

    def parts(self) -> list[Part]:
        """The inner store's parts, in the transformed basis (see :attr:`basis`)."""
        return [dataclasses.replace(p, basis=self.transform) for p in self.inner.parts()]

    def nbytes(self) -> dict[str, int]:
        return self.inner.nbytes()

    def shared(self) -> list[tuple[str, torch.Tensor]]:
        """The inner store's, and the tensors the transform holds for this store's head dims
        (segment ``"transform"``)."""
        out = list(self.inner.shared())
        if self._dims is not None:
            for head_dim in sorted(set(self._dims)):
                out += [("transform", t) for t in self.transform.held(head_dim, self._device).values()]
        return out

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inner.map_batch(fn)

    def state_dict(self) -> dict[str, Any]:
        """The inner store's state (the transform itself is rebuilt from the cache's composition)."""
        return {
            "inner": self.inner.state_dict(), "dims": None if self._dims is None else list(self._dims),
            "dtype": None if self._dtype is None else _name(self._dtype),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state saved without ``"dtype"`` held its tokens in the model's
        dtype, and reads back in the dtype the inner store holds."""
        state_check.entries(state, "transformed store", ("inner", "dims"), ("dtype",))
        dtype = state.get("dtype")
        if dtype is not None and (not isinstance(dtype, str) or dtype not in _DTYPES):
            raise ValueError(f"a transformed store's dtype must be one of {sorted(_DTYPES)}; got dtype={dtype!r:.40}")
        self.inner.load_state_dict(state["inner"])
        dims = state["dims"]
        if dims is not None:
            if not isinstance(dims, list) or len(dims) != 2:
                raise ValueError(f"transformed store: dims {dims!r:.40} is not [key head_dim, value head_dim]")
            self._dims = (state_check.integer(dims[0], "dims[0]", 1), state_check.integer(dims[1], "dims[1]", 1))
            self._device = self.inner.positions.device
        self._dtype = None if dtype is None else state_check.dtype_of(dtype, "a transformed store's dtype")

    def validate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The inner store's checks (its tokens in the dtype they are held in), and head dims and a
        model dtype recorded exactly when tokens are held, equal to the layer's."""
        if self._dtype is not None and self._dtype != keys.dtype:
            raise ValueError(f"transformed store: tokens of dtype {self._dtype} in a {keys.dtype} layer")
        held = keys.dtype if self._dtype is None else HELD_DTYPE.get(keys.dtype, keys.dtype)
        self.inner.validate(keys[:, :, :0].to(held), values[:, :, :0].to(held))
        expected = (keys.shape[-1], values.shape[-1]) if len(self.inner) else None
        if self._dims != expected:
            raise ValueError(f"transformed store: head dims {self._dims} recorded, expected {expected}")

    def __len__(self) -> int:
        return len(self.inner)

    def staged_key_positions(self) -> torch.Tensor:
        """The inner store's (:meth:`DemotedStore.staged_key_positions`)."""
        return self.inner.staged_key_positions()

    def staged_value_positions(self) -> torch.Tensor:
        """The inner store's (:meth:`DemotedStore.staged_value_positions`)."""
        return self.inner.staged_value_positions()


#: the names of the model dtypes a transformed store records (read with :func:`kvpolicy.state_check.dtype_of`)
_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _name(dtype: torch.dtype) -> str:
    return state_check.dtype_name(dtype)
