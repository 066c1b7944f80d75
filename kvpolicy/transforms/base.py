"""The transform contract: a change of basis of demoted keys and values, and the object it binds per layer.

A :class:`Transform` is a frozen dataclass of hyperparameters: an orthogonal map ``R`` of vectors of
``head_dim`` channels (``forward(x) = x R``, ``inverse(y) = y Rᵀ``), the same for every head, token and
batch row. Attention scores are invariant under an orthogonal map applied to both query and key
(``q·k = (qR)·(kR)``), and an attention output over transformed values maps back with ``inverse``.

Each compressed layer binds one :class:`Basis` (``transform.bind(context)``, with the layer's
:class:`BindContext`: its index, shapes, dtype, device and the model it serves): the per-layer object that
holds what the transform fits or keeps for that layer, called by the layer's engine
(:class:`kvpolicy.layer.engine.LayerEngine`) at declared points only:

- :meth:`Basis.observe`: the queries of a forward over the layer, while :attr:`Basis.wants_queries`;
- :meth:`Basis.fit`: the tokens of the layer's first demotion, before any is stored (the engine hands
  them whole when :attr:`Basis.fits_keys`);
- :meth:`Basis.add`: demoted tokens, mapped (:meth:`Basis.map_keys`) and given to the action's store;
- :meth:`Basis.unmap_keys` / :meth:`Basis.unmap_values`: the store's tokens back (materialised attention);
- :meth:`Basis.map_query`, :meth:`Basis.score_term`, :meth:`Basis.unmap_output`: fused decode attention
  over the store's parts (:func:`kvpolicy.fused.attend_parts`);
- :meth:`Basis.map_batch`, :meth:`Basis.nbytes`, :meth:`Basis.shared`, :meth:`Basis.state_dict`,
  :meth:`Basis.load_state_dict`, :meth:`Basis.validate`: batch moves, bytes and saving.

Stores know nothing of transforms, and backends never see one: they quantize whatever they are given.
Transforms know nothing about transformers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvpolicy.errors import MetadataOverflowError, NonFiniteError

if TYPE_CHECKING:
    from kvpolicy.actions.base import DemotedStore

#: model dtypes whose range a rotated coordinate can exceed, and the dtype their rotated tokens are held in
#: instead: a coordinate mixes every channel of its block, so it can reach ``√B`` times the block's largest
#: magnitude (float16: finite keys of 30000 in a block of 64 can give 240000). bfloat16 has float32's range.
HELD_DTYPE = {torch.float16: torch.float32}
#: the model dtypes a basis records (read back through :func:`kvpolicy.persist.dtype_of`)
MODEL_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class BindContext:
    """What a layer tells its transform when it binds one :class:`Basis` (:meth:`Transform.bind`).

    Built in one place, when a compressed layer starts (:meth:`BindContext.of`, from the layer's first
    keys and values and the model's config the cache was given), so every transform sees the same facts. A
    transform that keeps something per layer (a rotation calibrated offline, read from a file) finds its
    layer here and checks that the model is the one its data was measured on; the others ignore it.

    Attributes
    ----------
    layer_idx : int
        The layer's index in the model (``0 ≤ layer_idx``; ``< num_layers`` when that is known).
    num_layers : int or None
        The model's decoder layers (``num_hidden_layers``), when the cache was given the model's config.
    num_kv_heads : int
        KV heads of the layer's keys (this process's share under tensor parallelism).
    key_head_dim, value_head_dim : int
        Channels of a key and of a value.
    dtype : torch.dtype
        The model's dtype (that of the layer's keys).
    device : torch.device
        Where the layer's tokens are.
    model_type : str or None
        The config's ``model_type`` (e.g. ``"llama"``), when the cache was given the model's config.
    name_or_path : str or None
        The config's ``name_or_path`` (where the model was loaded from; ``""`` when unknown), likewise.
    config : object or None
        The model's config itself (a transformers ``PretrainedConfig``), for what the fields above do not say;
        ``None`` when the cache was built without ``config=``.
    """

    layer_idx: int
    num_layers: int | None
    num_kv_heads: int
    key_head_dim: int
    value_head_dim: int
    dtype: torch.dtype
    device: torch.device
    model_type: str | None = None
    name_or_path: str | None = None
    config: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, config: Any = None) -> BindContext:
        """The context of layer ``layer_idx`` whose first ``keys``/``values`` are ``(batch, kv_heads, n,
        head_dim)``, in a cache built for the model of ``config`` (``None``: a cache built without one)."""
        text = config
        if config is not None and hasattr(config, "get_text_config"):
            text = config.get_text_config(decoder=True)
        layers = getattr(text, "num_hidden_layers", None)
        model_type = getattr(text, "model_type", None)
        name = getattr(config, "name_or_path", None) if config is not None else None
        return cls(
            layer_idx=layer_idx, num_layers=layers if isinstance(layers, int) else None,
            num_kv_heads=keys.shape[1], key_head_dim=keys.shape[-1], value_head_dim=values.shape[-1],
            dtype=keys.dtype, device=keys.device, model_type=None if model_type is None else str(model_type),
            name_or_path=None if name is None else str(name), config=config,
        )  # fmt: skip


@dataclass(frozen=True)
class Transform(ABC):
    """Base class of transforms (dataclass hyperparameters, validated on construction).

    ``forward(x) = x R`` and ``inverse(y) = y Rᵀ`` with ``R`` orthogonal; the same parameters give the same
    ``R`` in every process (tensor-parallel ranks, saved caches). :func:`kvpolicy.testing.check_transform`
    checks this contract, and the one of the :class:`Basis` it binds.
    """

    #: registry name, e.g. ``"hadamard"``
    name: ClassVar[str] = ""
    #: True for the ``"none"`` transform: the cache then skips the stage entirely
    identity: ClassVar[bool] = False
    #: whether the bound basis fits something per layer (on the prompt's queries or the first demotion), so
    #: that :meth:`forward` alone is not the whole transform (a chunk codec or an analysis of ``R`` cannot
    #: apply it)
    fits: ClassVar[bool] = False
    #: whether the bound basis fits on the queries of the forwards before a layer's first demotion, which
    #: kvpolicy's attention wrapper reports (:func:`kvpolicy.attention.enable_scores`)
    needs_queries: ClassVar[bool] = False

    def check_head_dim(self, head_dim: int) -> None:  # noqa: B027 - optional hook
        """Raise :class:`~kvpolicy.errors.ConfigError` if vectors of ``head_dim`` channels cannot be
        transformed (checked on a layer's first update, for keys and for values)."""

    def check_key_head_dim(self, head_dim: int) -> None:  # noqa: B027 - optional hook
        """Raise :class:`~kvpolicy.errors.ConfigError` if keys of ``head_dim`` channels cannot be served
        (checked on a layer's first update, after :meth:`check_head_dim`; for what concerns keys alone)."""

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x R``: ``(..., head_dim)`` in, the same shape and dtype out (computed in float32 or wider)."""

    @abstractmethod
    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``y Rᵀ``, undoing :meth:`forward`: the same shape and dtype as ``y``."""

    def held(self, head_dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Tensors the transform keeps to serve ``head_dim`` on ``device`` (e.g. its matrix), by role; a
        memory report counts each once, however many layers and caches share it."""
        return {}

    def bind(self, context: BindContext) -> Basis:
        """The object one layer holds its demoted tokens' basis in (:class:`Basis`; a transform that fits
        or keeps something per layer returns a subclass).

        Parameters
        ----------
        context : BindContext
            The layer binding it: its index, shapes, dtype and device, and the model (a transform that needs
            none of it ignores it). Raise :class:`~kvpolicy.errors.ConfigError` (or ``ValueError`` for a file
            the transform reads) here, before the layer allocates anything, when the layer cannot be served.
        """
        return Basis(self)


@dataclass(frozen=True)
class NoTransform(Transform):
    """The identity (``transform="none"``, the default): demoted tokens are stored as they are."""

    name = "none"
    identity = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return y


class Basis:
    """One layer's basis of demoted tokens: the transform's map, and whatever it fits or keeps for the layer.

    This base class serves an orthogonal transform: keys and values are stored as ``forward(x)`` (in
    :data:`HELD_DTYPE` where the model's dtype could not hold them), come back through ``inverse`` in the
    model's dtype, and fused attention rotates the query into the stored basis and the output back. A
    transform that fits or keeps more returns a subclass from :meth:`Transform.bind` and overrides the
    methods it needs (the research plugin, ``plugins/kvpolicy-research``, holds worked examples).

    Attributes
    ----------
    transform : Transform
        The transform bound.
    dims : (int, int) or None
        ``(key head_dim, value head_dim)`` once tokens are held.
    dtype : torch.dtype or None
        The model's dtype once tokens are held (the dtype the tokens come back in).
    """

    #: whether :meth:`fit` reads the first demotion's tokens: the layer then hands that demotion whole (never
    #: in chunks), and at the time it always comes (see ``kvpolicy.layer.engine``)
    fits_keys: ClassVar[bool] = False
    #: whether the basis waits for the queries of the next forward (:meth:`observe`)
    wants_queries: bool = False
    #: whether :meth:`fit` was called (or nothing is fitted): the engine calls it once, before the first add
    fitted: bool = True

    def __init__(self, transform: Transform) -> None:
        self.transform = transform
        self.dims: tuple[int, int] | None = None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None

    # ------------------------------------------------------------------ fitting
    def observe(self, query: torch.Tensor, keys: torch.Tensor) -> None:
        """The queries ``(batch, q_heads, q, head_dim)`` of a forward over the layer (in the model's basis)
        and the keys ``(batch, kv_heads, n, head_dim)`` they read; called while :attr:`wants_queries`."""

    def fit(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fit on the first demotion, ``(batch, kv_heads, n, head_dim)`` in the model's basis, before any of
        it is stored; a basis that fits sets :attr:`fitted` here."""

    # ------------------------------------------------------------------ storing and reading back
    def map_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Demoted keys ``(batch, kv_heads, n, head_dim)`` (already in the dtype they are held in) in the
        stored basis; ``positions`` ``(rows, n)`` are theirs."""
        return self.transform.forward(keys)

    def add(self, store: DemotedStore, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Map demoted ``keys``/``values`` ``(batch, kv_heads, n, head_dim)`` and give them to ``store``.

        Raises
        ------
        NonFiniteError
            If finite tokens leave the map non-finite (beyond the range of float32, or of bfloat16): the
            message names the transform, not the input.
        MetadataOverflowError
            If the store's metadata dtype cannot hold the mapped tokens' groups (its message names the
            remedy, and the transform).
        """
        wide = HELD_DTYPE.get(keys.dtype, keys.dtype)
        mapped = self.map_keys(keys.to(wide), positions), self.transform.forward(values.to(wide))
        try:
            store.add(*mapped, positions)
        except MetadataOverflowError as exc:
            raise MetadataOverflowError(
                f"{exc} (These were {_name(keys.dtype)} tokens rotated by {self.transform!r}, held in "
                f"{_name(wide)}: a rotated coordinate mixes every channel of its block, so its magnitude can "
                "exceed the largest of the tokens' own.)"
            ) from None
        except NonFiniteError:
            if not (bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())):
                raise  # the input itself was not finite: the store's message is right
            for what, original, out in (("keys", keys, mapped[0]), ("values", values, mapped[1])):
                if not bool(torch.isfinite(out).all()):
                    amax = float(original.detach().abs().amax())
                    raise NonFiniteError(
                        f"{self.transform!r} turned finite {_name(original.dtype)} {what} (largest |value| "
                        f"{amax:.4g}) into non-finite ones: a rotated coordinate mixes every channel of its block "
                        f"and exceeded the range of {_name(out.dtype)} ({torch.finfo(out.dtype).max:.4g}). Scale "
                        "the model's activations down, or use transform='none' for this model."
                    ) from None
            raise
        if self.dims is None:
            self.dims, self.device = (keys.shape[-1], values.shape[-1]), keys.device
        self.dtype = keys.dtype

    def unmap_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The store's keys ``(batch, kv_heads, n, head_dim)`` (at ``positions``, ``(rows, n)``) in the model's
        basis and dtype."""
        return self._back(keys)

    def unmap_values(self, values: torch.Tensor) -> torch.Tensor:
        """The store's values ``(batch, kv_heads, n, head_dim)`` in the model's basis and dtype."""
        return self._back(values)

    def _back(self, y: torch.Tensor) -> torch.Tensor:
        return cast_clamped(self.transform.inverse(y), y.dtype if self.dtype is None else self.dtype)

    # ------------------------------------------------------------------ fused attention
    def map_query(self, query: torch.Tensor) -> torch.Tensor:
        """Decode queries ``(batch, kv_heads, q, head_dim)`` in the stored keys' basis, float32."""
        return self.transform.forward(query.float())

    def score_term(self, query: torch.Tensor, scale: float) -> torch.Tensor | None:
        """What each stored token scores outside its codes, per position: ``(batch, kv_heads, q, P)`` float32,
        column ``p`` added to the scaled score of the token at position ``p`` (``query`` ``(batch, kv_heads,
        q, head_dim)`` in the model's basis); ``None``: nothing (the codes are the whole key)."""
        return None

    def unmap_output(self, out: torch.Tensor) -> torch.Tensor:
        """An attention output ``(batch, kv_heads, q, head_dim_v)`` over the stored values, in the model's basis."""
        return self.transform.inverse(out)

    # ------------------------------------------------------------------ batch moves and bytes
    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-axis (dim 0) operation to every tensor held per batch row (fits, moments, tables)."""

    def nbytes(self) -> dict[str, int]:
        """Bytes held for this layer alone, by memory-report segment (``codes``, ``scales``...)."""
        return {}

    def shared(self) -> list[tuple[str, torch.Tensor]]:
        """``(segment, tensor)`` of what other layers may hold too (the transform's matrix), counted once."""
        if self.dims is None:
            return []
        return [("transform", t) for d in sorted(set(self.dims)) for t in self.transform.held(d, self.device).values()]

    # ------------------------------------------------------------------ saving
    def state_dict(self) -> dict[str, Any]:
        """What the layer saves beside its store's state (the transform itself is rebuilt from the composition)."""
        return {
            "dims": None if self.dims is None else list(self.dims),
            "dtype": None if self.dtype is None else _name(self.dtype),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore :meth:`state_dict` (untrusted: ``ValueError`` names what is wrong); ``device``: the layer's.
        A state saved without ``"dtype"`` held its tokens in the model's dtype."""
        from kvpolicy import persist, state_check

        state_check.entries(state, "transformed store", ("dims",), ("dtype",))
        dtype = state.get("dtype")
        if dtype is not None and (not isinstance(dtype, str) or dtype not in MODEL_DTYPES):
            raise ValueError(
                f"a transformed store's dtype must be one of {sorted(MODEL_DTYPES)}; got dtype={dtype!r:.40}"
            )
        dims = state["dims"]
        if dims is not None:
            if not isinstance(dims, list) or len(dims) != 2:
                raise ValueError(f"transformed store: dims {dims!r:.40} is not [key head_dim, value head_dim]")
            self.dims = (state_check.integer(dims[0], "dims[0]", 1), state_check.integer(dims[1], "dims[1]", 1))
            self.device = device
        self.dtype = None if dtype is None else persist.dtype_of(dtype, "a transformed store's dtype")

    def held_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the store holds a layer of ``model_dtype``'s tokens in (after :meth:`load_state_dict`:
        ``ValueError`` if the recorded model dtype is another)."""
        if self.dtype is None:
            return model_dtype
        if self.dtype != model_dtype:
            raise ValueError(f"transformed store: tokens of dtype {self.dtype} in a {model_dtype} layer")
        return HELD_DTYPE.get(model_dtype, model_dtype)

    def validate(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """After :meth:`load_state_dict`: raise ``ValueError`` unless what is held fits a layer whose
        full-precision tokens are ``keys``/``values`` ``(batch, kv_heads, n, head_dim)`` and whose store holds
        ``positions`` ``(rows, n_stored)``: here, head dims recorded exactly when tokens are held."""
        expected = (keys.shape[-1], values.shape[-1]) if positions.shape[-1] else None
        if self.dims != expected:
            raise ValueError(f"transformed store: head dims {self.dims} recorded, expected {expected}")


def cast_clamped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, finite values beyond ``dtype``'s range clamped to its largest finite value.

    For a reconstruction computed wider than the model's dtype (an un-rotation in float32): the original
    tokens were finite in ``dtype``, so a value just beyond its range is quantization error past the edge,
    and clamping moves it towards the original. NaN and ±Inf stay as they are. ``x`` itself when it is in
    ``dtype`` already.
    """
    if x.dtype == dtype:
        return x
    top = torch.finfo(dtype).max
    if torch.finfo(x.dtype).max > top:
        x = torch.where(torch.isinf(x), x, x.clamp(-top, top))
    return x.to(dtype)


def _name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"`` (as :func:`kvpolicy.persist.dtype_name`)."""
    return str(dtype).removeprefix("torch.")
