"""The format contract: a quantized tensor format owns its blocks' methods and its reference attention.

A *format* is two classes, in one file under ``kvpolicy/formats/``:

- a frozen :class:`Format` spec (its parameters: bits, group, fit, metadata dtype...) whose
  :meth:`Format.quantize` is the reference quantizer, in plain torch;
- a :class:`QTensor` block that owns ``dequantize``, ``cat``, ``narrow``, ``select``, ``map_batch``,
  its saved state (``state`` / ``from_state``), its bytes (``tensors``) and the two halves of the
  reference attention (``scores`` of keys, ``mix`` of values).

Backends add fast kernels per format (:class:`~kvpolicy.backends.base.Backend`'s tables keyed by the
spec and block classes) and fall back to these methods elsewhere, so a new format works in every
backend that serves formats by reference (``torch``) before it has a kernel. Nothing here imports a
backend, an action or transformers.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from kvpolicy.errors import ConfigError, MetadataOverflowError

AXES = ("token", "channel")
#: ``meta_dtype`` values: ``"auto"`` (each backend's default) or the name of the dtype scales and
#: minimums are stored in
META_DTYPES = ("auto", "float16", "bfloat16", "float32")
#: how a min-max group's range is chosen: its extremes (``"minmax"``) or the range of least squared
#: error (``"mse"``; same storage, same kernels)
FITS = ("minmax", "mse")
#: ``meta_dtype`` names -> the dtype scales and minimums are stored in
META_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
#: the largest finite float16 (float16 outputs of ``dequantize`` are clamped to it)
FP16_MAX = torch.finfo(torch.float16).max


def dense_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 attention in the mergeable ``(out, lse)`` form of :meth:`Backend.attend`.

    ``query`` ``(B, H, q, D)`` over ``keys``/``values`` ``(B, H, n, D)``; ``bias`` ``(B, H, q, n)``, if
    given, is added to the scaled scores. Returns ``out`` ``(B, H, q, Dv)`` and ``lse`` ``(B, H, q)``,
    both float32.
    """
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values.float())
    return out, lse


def metadata_may_overflow(dtype: torch.dtype, meta: torch.dtype) -> bool:
    """Whether finite input of ``dtype`` can give scales or minimums beyond the range of ``meta``.

    True when ``meta`` holds smaller magnitudes than ``dtype`` (float32 or float64 input with float16
    metadata, float32 input with bfloat16, float64 input with any). Otherwise only groups within a
    factor of about 2 of float32's maximum can overflow (``max - min`` in float32).
    """
    return torch.finfo(meta).max < torch.finfo(dtype).max


def check_metadata(backend: str, x: torch.Tensor, meta: dict[str, torch.Tensor], remedy: str) -> None:
    """Raise :class:`~kvpolicy.errors.MetadataOverflowError` if finite ``x`` gave non-finite metadata.

    One reduction over the metadata (``1 / G`` of the input) and one host synchronisation. When the
    metadata is not finite because ``x`` itself is not (NaN / Inf input), nothing is raised: refusing
    non-finite input is the caller's choice (``Quantize(check_finite=True)`` does it before quantizing).

    Parameters
    ----------
    backend : str
        The backend's name, for the message.
    x : torch.Tensor
        ``(batch, kv_heads, tokens, head_dim)``, the input just quantized.
    meta : dict of str to torch.Tensor
        The floating-point metadata held for ``x``, by role (``scales``, ``zeros``), any shapes.
    remedy : str
        What the user can do, appended to the message.
    """
    if not meta:
        return
    if bool(torch.isfinite(torch.cat([t.reshape(-1) for t in meta.values()])).all()):  # one reduction
        return
    if not bool(torch.isfinite(x).all()):
        return
    counts = ", ".join(f"{n} non-finite {name}" for name, t in meta.items() if (n := int((~torch.isfinite(t)).sum())))
    dtypes = "/".join(sorted({str(t.dtype).removeprefix("torch.") for t in meta.values()}))
    limit = min(torch.finfo(t.dtype).max for t in meta.values())
    amax = float(x.detach().abs().amax()) if x.numel() else 0.0
    raise MetadataOverflowError(
        f"backend {backend!r}: quantizing finite {str(x.dtype).removeprefix('torch.')} values (largest |value| "
        f"{amax:.4g}) gave {counts} in {dtypes} metadata, which holds magnitudes up to {limit:.6g} (a group's "
        f"minimum, and its scale (max - min) / (2**bits - 1), must fit); dequantizing would give NaN/Inf. {remedy}"
    )


def widen_remedy(meta: torch.dtype, supported: tuple[str, ...]) -> str:
    """What to do when metadata overflowed in ``meta``, given the ``meta_dtype`` values supported."""
    wider = [n for n in ("float32", "bfloat16") if n in supported and str(meta) != f"torch.{n}"]
    if meta == torch.float16 and wider:
        options = " or ".join(f"meta_dtype={n!r}" for n in wider)
        return (
            f"Store the metadata with float32's range: {options} (Quantize(meta_dtype='float32') or "
            "CompressedCache(..., meta_dtype='float32'); float32 costs 32 more bits per group, bfloat16 the "
            "same bytes as float16 with an 8-bit significand)."
        )
    return (
        "Magnitudes this close to float32's limit (3.4e38) mean the model's keys/values are overflowing; "
        "check the model and the dtype it runs in."
    )


def meta_dtype(dtype: torch.dtype) -> torch.dtype:
    """The default (``meta_dtype="auto"``) 16-bit dtype of scales and minimums of a tensor of ``dtype``."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


def resolve_meta_dtype(option: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype scales and minimums of a ``dtype`` tensor are stored in under ``meta_dtype=option``.

    Raises
    ------
    ConfigError
        If ``option`` is not one of :data:`META_DTYPES`.
    """
    if option == "auto":
        return meta_dtype(dtype)
    if option not in META_TORCH_DTYPES:
        raise ConfigError(f"meta_dtype must be one of {list(META_DTYPES)}; got meta_dtype={option!r}")
    return META_TORCH_DTYPES[option]


def in_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 reconstruction in ``dtype``; float16 outputs are clamped to ``±65504`` first (the top of a
    grid can pass 65504 by a few ulps, and would otherwise come back as ``inf``; clamping moves such an
    element towards its input, so error bounds hold)."""
    if dtype == torch.float16:
        out = out.clamp_(-FP16_MAX, FP16_MAX)
    return out.to(dtype)


class QTensor(ABC):
    """A quantized block of keys or values, logically shaped ``(batch, kv_heads, tokens, head_dim)``.

    Subclasses hold their own tensors; ``tensors()`` names every tensor held so bytes can be counted
    from what is really stored. A format's block owns its methods: :meth:`dequantize`, :meth:`cat`,
    :meth:`narrow`, :meth:`select`, :meth:`map_batch`, its saved state (:meth:`state`,
    :meth:`from_state`, under the names in :attr:`layouts`) and the halves of the reference attention
    (:meth:`scores`, :meth:`mix`).
    """

    #: logical shape ``(batch, kv_heads, tokens, head_dim)``
    shape: tuple[int, int, int, int]
    #: dtype of the original (and dequantized) tensor
    dtype: torch.dtype
    #: the ``"layout"`` entries of :meth:`state` this class reads back in :meth:`from_state`
    layouts: ClassVar[tuple[str, ...]] = ()
    #: whether every tensor field of this dataclass block has the token axis at dim 2 (one entry per
    #: token): :meth:`narrow` and :meth:`cat` then need no code of their own
    per_token: ClassVar[bool] = False

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this container holds, keyed by role (``codes``, ``scales``, ``zeros``...)."""

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QTensor:
        """Apply a batch-axis (dim 0) operation to every held tensor and return the new container
        (default: every tensor field of a dataclass block)."""
        mapped = {name: fn(t) for name, t in self._fields().items() if isinstance(t, torch.Tensor)}
        batch = next(iter(mapped.values())).shape[0]
        return dataclasses.replace(self, **mapped, shape=(batch, *self.shape[1:]))  # type: ignore[type-var]

    def dequantize(self) -> torch.Tensor:
        """``(batch, kv_heads, tokens, head_dim)`` in :attr:`dtype`: the reconstruction."""
        raise NotImplementedError(f"{type(self).__name__} does not implement dequantize()")

    @classmethod
    def cat(cls, blocks: list[QTensor]) -> QTensor:
        """Blocks of the same configuration concatenated along the token axis (default, for
        :attr:`per_token` dataclass blocks: every tensor field along dim 2)."""
        if len(blocks) == 1:
            return blocks[0]
        if not cls.per_token:
            raise NotImplementedError(f"{cls.__name__} does not implement cat()")
        first = blocks[0]
        joined = {
            name: torch.cat([getattr(b, name) for b in blocks], dim=2)
            for name, t in first._fields().items()
            if isinstance(t, torch.Tensor)
        }
        shape = (*first.shape[:2], sum(b.shape[2] for b in blocks), first.shape[3])
        return dataclasses.replace(first, **joined, shape=shape)  # type: ignore[type-var]

    def narrow(self, start: int, length: int) -> QTensor:
        """Tokens ``[start, start + length)`` (per-channel blocks: whole groups). Optional: the fused
        decode path (:mod:`kvpolicy.fused`) needs it when a store's key and value streams hold
        different numbers of quantized tokens; without it that path is not used."""
        if not self.per_token:
            raise NotImplementedError(f"{type(self).__name__} does not implement narrow()")
        if start < 0 or length < 0 or start + length > self.shape[2]:
            raise ValueError(f"narrow(start={start}, length={length}) on a block of {self.shape[2]} tokens")
        cut = {n: t[:, :, start : start + length] for n, t in self._fields().items() if isinstance(t, torch.Tensor)}
        return dataclasses.replace(self, **cut, shape=(*self.shape[:2], length, self.shape[3]))  # type: ignore[type-var]

    def select(self, index: torch.Tensor) -> QTensor:
        """Tokens ``index`` (a 1-D index into the token axis), in that order, of a block quantized per
        token: every tensor field of a dataclass container indexed along dim 2. Containers holding a
        tensor without a token axis override it (a codebook block keeps its centre)."""
        picked = {name: t.index_select(2, index) for name, t in self._fields().items() if isinstance(t, torch.Tensor)}
        shape = (*self.shape[:2], int(index.numel()), self.shape[3])
        return dataclasses.replace(self, **picked, shape=shape)  # type: ignore[type-var]

    def state(self) -> dict:
        """This block as JSON values and tensors, with a ``"layout"`` entry naming it (one of
        :attr:`layouts`), for a saved cache. Optional: a block without it cannot be saved."""
        raise NotImplementedError(f"{type(self).__name__} does not implement state()")

    @classmethod
    def from_state(cls, state: dict) -> QTensor:
        """The block :meth:`state` described, every entry checked (``state`` comes from a file)."""
        raise NotImplementedError(f"{cls.__name__} does not implement from_state()")

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """``query · k̂`` of every key of this block: ``query`` ``(B, H, q, D)`` float32 (already scaled)
        to ``(B, H, q, n)`` float32. Default: against the dequantized keys."""
        return torch.matmul(query, self.dequantize().float().transpose(-1, -2))

    def mix(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs @ v̂``: ``probs`` ``(B, H, q, n)`` float32 to ``(B, H, q, Dv)`` float32. Default: the
        dequantized values."""
        return torch.matmul(probs, self.dequantize().float())

    @property
    def num_tokens(self) -> int:
        """Number of tokens held."""
        return self.shape[2]

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by role."""
        return {name: t.numel() * t.element_size() for name, t in self.tensors().items()}


class Format(ABC):
    """A quantized tensor format's parameters (subclasses: frozen dataclasses, validated on construction).

    The fields are the format's options (``Quantize``'s shortcut keywords name them per role:
    ``key_bits`` is the keys' ``bits``). Class attributes say what the format is; the cache and backends
    read them, never the class:

    - :attr:`name`: the scheme name (``Quantize(scheme=name)``) and its registry name;
    - :attr:`block`: the :class:`QTensor` class :meth:`quantize` returns;
    - :attr:`backends`: the backends that serve it beyond those whose capabilities name it;
    - :attr:`grouped`: whether ``group_size`` and ``axis`` apply (min-max groups), or every token is
      quantized on its own (``axis`` is ``"token"``, ``group_size`` ``None``);
    - :attr:`bits_allowed`, :attr:`head_dim_multiple`, :attr:`needs_rotation`, :attr:`centred`.
    """

    name: ClassVar[str] = ""
    block: ClassVar[type[QTensor]]
    #: backends serving this format besides those whose ``capabilities.formats`` name it: ``torch``
    #: stores and attends over every format through the format's own methods; a format a plugin registers
    #: names the built-in backends that read its blocks (``cpu``: blocks of scaled table codes,
    #: :class:`~kvpolicy.formats.codebook.ScaledBlock`)
    backends: ClassVar[tuple[str, ...]] = ("torch",)
    grouped: ClassVar[bool] = False
    #: options added after the format's first release: a saved spec without one holds its default (a saved
    #: spec lacking any other option is refused, as its default need not be what the stored blocks hold)
    options_added: ClassVar[tuple[str, ...]] = ()
    #: code widths the format has
    bits_allowed: ClassVar[tuple[int, ...]] = ()
    #: head dims must be a multiple of this (codes packed into whole bytes)
    head_dim_multiple: ClassVar[int] = 1
    #: whether the format assumes rotated, near-Gaussian coordinates (a cache refuses it without a rotation)
    needs_rotation: ClassVar[bool] = False
    #: whether :meth:`quantize` takes a ``centre`` (an offset shared by a stream's blocks)
    centred: ClassVar[bool] = False
    #: parameters added after the format was first released, each with the value that computes exactly what
    #: the format computed before it existed; what names a composition by hashing its spec (the lab's cell
    #: ids) leaves a parameter out at that value, so results measured before it was added stay matched
    added_defaults: ClassVar[dict[str, object]] = {}

    bits: int
    meta_dtype: str
    #: the grouping axis (``"token"``: every token quantized on arrival); grouped formats make it a field
    axis = "token"
    #: elements per group (``None``: the format has no groups); grouped formats make it a field
    group_size = None
    #: how a min-max group's range is chosen (``"minmax"`` for formats without ranges to fit)
    fit = "minmax"
    #: whether blocks are quantized around a stream's centre; :attr:`centred` formats make it a field
    centre = False

    @abstractmethod
    def quantize(self, x: torch.Tensor, backend: Any = "torch", centre: torch.Tensor | None = None) -> QTensor:
        """The reference quantizer: ``x`` ``(batch, kv_heads, tokens, head_dim)`` to a :attr:`block`.

        Parameters
        ----------
        x : torch.Tensor
            The tokens.
        backend : Backend or str
            The backend an overflow error names (and whose ``capabilities.meta_dtypes`` its remedy offers).
        centre : torch.Tensor, optional
            ``(batch, kv_heads, 1, head_dim)``, an offset shared by a stream's blocks (formats with
            :attr:`centred` only).

        Raises
        ------
        MetadataOverflowError
            If finite ``x`` would be stored with non-finite metadata.
        """

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The format's parameters (its dataclass fields), which ``Quantize``'s shortcut keywords set per role."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def for_role(cls, role: str, options: dict[str, Any]) -> tuple[Format, tuple[str, ...]]:
        """The format of keys (``role="key"``) or values (``"value"``) that ``options`` (some of :meth:`options`)
        describe, this format's defaults for the role filling the rest, and the options those defaults filled
        that :meth:`serving` may replace. Default: ``cls(**options)``, nothing to replace."""
        return cls(**options), ()

    def serving(
        self, backend: Any, role: str, head_dim: int | None, defaulted: tuple[str, ...]
    ) -> tuple[Format, tuple[str, ...], tuple[str, ...]]:
        """This format with each option in ``defaulted`` (filled by :meth:`for_role`'s defaults) that ``backend``
        or the head dim cannot serve replaced: the format, the options replaced and a note per replacement
        (naming the role's keyword: ``key_fit='minmax' (...)``). Default: nothing to replace."""
        return self, (), ()

    def metadata_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype this format stores the metadata (scales, minimums, a centre) of ``dtype`` tensors in:
        :attr:`meta_dtype`, ``"auto"`` resolved (:func:`resolve_meta_dtype`)."""
        return resolve_meta_dtype(self.meta_dtype, dtype)

    def for_dtype(self, dtype: torch.dtype) -> Format:
        """This format with ``meta_dtype="auto"`` replaced by the dtype it means for ``dtype`` tensors (what a
        store of those tensors holds, written out: for quantizing them as another dtype)."""
        if self.meta_dtype != "auto":
            return self
        name = str(self.metadata_dtype(dtype)).removeprefix("torch.")
        return dataclasses.replace(self, meta_dtype=name)  # type: ignore[type-var]

    @classmethod
    def examples(cls, backend: Any) -> list[Format]:
        """Specs of this format that :func:`kvpolicy.testing.check_backend` checks ``backend`` with (before
        asking whether it serves them): one per width. Formats with more options add their variants."""
        return [cls(bits=bits) for bits in cls.bits_allowed]  # type: ignore[call-arg]


def backend_name(backend: Any) -> str:
    """The name an error gives ``backend`` (a :class:`Backend` or a string)."""
    return backend if isinstance(backend, str) else backend.name


def backend_meta_dtypes(backend: Any) -> tuple[str, ...]:
    """The ``meta_dtype`` values a remedy may offer for ``backend`` (a name alone: all of them)."""
    return META_DTYPES if isinstance(backend, str) else backend.capabilities.meta_dtypes


def check_meta_dtype_option(owner: str, meta_dtype: object) -> None:
    """Raise :class:`ConfigError` unless ``meta_dtype`` is one of :data:`META_DTYPES`."""
    if not isinstance(meta_dtype, str) or meta_dtype not in META_DTYPES:
        raise ConfigError(f"{owner}: meta_dtype must be one of {list(META_DTYPES)}; got meta_dtype={meta_dtype!r}")


def check_bits(owner: str, bits: object, allowed: tuple[int, ...]) -> None:
    """Raise :class:`ConfigError` unless ``bits`` is one of ``allowed``."""
    if isinstance(bits, bool) or bits not in allowed:
        raise ConfigError(f"{owner}: bits must be one of {list(allowed)}; got bits={bits!r}")


def attend(
    query: torch.Tensor, keys: QTensor, values: QTensor, scale: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a quantized segment from its formats' own :meth:`QTensor.scores` and
    :meth:`QTensor.mix` (the ``torch`` backend's ``attend``), in the mergeable ``(out, lse)`` form.

    ``query`` ``(B, H, q, D)``; ``keys``/``values`` ``(B, H, n, D)`` / ``(B, H, n, Dv)``; ``bias``
    ``(B, H, q, n)``, if given, is added to the scaled scores. Returns float32 ``out`` ``(B, H, q, Dv)``
    and ``lse`` ``(B, H, q)`` (zeros and ``-inf`` when ``n = 0``).
    """
    b, h, nq, _ = query.shape
    if keys.shape[2] == 0:
        dv = values.shape[3]
        return query.new_zeros((b, h, nq, dv), dtype=torch.float32), query.new_full(
            (b, h, nq), -float("inf"), dtype=torch.float32
        )
    scores = keys.scores(query.float() * scale)
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))  # (B, H, q, n)
    return values.mix(probs), lse


def reference_attend(
    query: torch.Tensor,
    keys: QTensor,
    values: QTensor,
    scale: float,
    dequantize: Callable | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference every fast kernel is tested against: :func:`dense_attention` of the dequantized
    blocks (``dequantize``: a backend's, default each block's own; ``bias``: added to the scores)."""
    deq = dequantize if dequantize is not None else (lambda q: q.dequantize())
    return dense_attention(query, deq(keys), deq(values), scale, bias)
