"""The backend contract: how quantized bits are stored, and which kernels read them.

A backend turns a floating-point tensor into a quantized block of a format (``quantize(x, fmt)``),
turns it back (``dequantize``), concatenates blocks along the token axis and attends over them. The
formats (:mod:`kvpolicy.formats`) own their blocks' methods and reference attention; a backend adds
kernels per format in three tables and falls back to the format's own methods elsewhere. Backends know
nothing about policies or about transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvpolicy import formats
from kvpolicy.errors import ConfigError
from kvpolicy.formats.base import (  # noqa: F401 - re-exported: the backend contract's names
    AXES,
    META_DTYPES,
    Format,
    QTensor,
    check_metadata,
    dense_attention,
    metadata_may_overflow,
    reference_attend,
    widen_remedy,
)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; checked when a cache is constructed. Nothing here is about one format: a
    backend serves a format that its :attr:`formats` name or that names it (``Format.backends``), and
    refuses the options of a format it cannot read in its own :meth:`Backend.check_format`.

    Parameters
    ----------
    bits : tuple of int
        Supported code widths (of every format it serves).
    axes : tuple of str
        Supported grouping axes of grouped formats (``"token"``: groups of channels of one token;
        ``"channel"``: groups of tokens of one channel).
    group_size_multiple : int
        Group sizes must be positive multiples of this number (packing granularity).
    devices : tuple of str
        Device types the kernels run on.
    dtypes : tuple of torch.dtype
        Input dtypes accepted.
    fused : bool
        Whether the fused decode path (:mod:`kvpolicy.fused`) can read this backend's blocks
        (``attend`` over blocks that ``QTensor.narrow`` can cut to whole groups). Without it,
        ``attention="auto"`` materialises the history and ``attention="fused"`` is refused.
    meta_dtypes : tuple of str
        ``meta_dtype`` values accepted (see :data:`META_DTYPES`); ``("auto",)``: the backend stores its
        metadata its own way and takes no ``meta_dtype`` argument.
    bit_pairs : tuple of (int, int), optional
        ``(key_bits, value_bits)`` pairs served when keys and values differ; ``None``: every pair of
        ``bits`` (keys and values are quantized, stored and attended independently).
    formats : tuple of str
        Names of the formats served (``quantize`` is handed their :class:`~kvpolicy.formats.base.Format`
        specs), besides those whose ``backends`` name this backend.
    """

    bits: tuple[int, ...]
    axes: tuple[str, ...]
    group_size_multiple: int
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    fused: bool = True
    meta_dtypes: tuple[str, ...] = ("auto",)
    bit_pairs: tuple[tuple[int, int], ...] | None = None
    formats: tuple[str, ...] = ("minmax",)


@dataclass(frozen=True)
class Usability:
    """Whether a backend can run on this machine (``kvpolicy list`` shows it; :meth:`Backend.usability` says it).

    Parameters
    ----------
    usable : bool
        It can run here (on some device of this machine).
    note : str
        Why not, and what to install or set; or, when usable, a qualification (``"CUDA tensors only"``).
    """

    usable: bool
    note: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.usable, bool):
            raise ConfigError(f"Usability: usable must be True or False; got usable={self.usable!r}")
        if not isinstance(self.note, str):
            raise ConfigError(f"Usability: note must be a string; got note={self.note!r}")


class Backend:
    """Packs and unpacks quantized tensors: formats' blocks, with fast kernels per format.

    Implementations must agree with each format's reference (its :meth:`~kvpolicy.formats.base.Format.quantize`,
    :meth:`~kvpolicy.formats.base.QTensor.dequantize` and :func:`~kvpolicy.formats.base.reference_attend`)
    within one quantization step (``|x - x_hat| <= s / 2`` plus the rounding of the output dtype);
    :func:`kvpolicy.testing.check_backend` checks it.

    A backend registers its kernels in three tables keyed by format classes; whatever has no kernel is
    the format's own method (the reference). A new format therefore needs no edit here: it works in
    every backend whose capabilities serve it, before any kernel exists.
    """

    name: str = ""
    capabilities: Capabilities
    #: fast quantizers: ``{Format subclass: fn(backend, x, fmt, centre) -> QTensor}``
    quantizers: ClassVar[Mapping[type, Callable[..., QTensor]]] = {}
    #: fast dequantizers: ``{QTensor subclass: fn(backend, q) -> torch.Tensor}``
    dequantizers: ClassVar[Mapping[type, Callable[..., torch.Tensor]]] = {}
    #: fast decode attention: ``{(key block class, value block class): fn(backend, query, keys, values, scale)}``
    attention_kernels: ClassVar[Mapping[tuple[type, type], Callable[..., tuple[torch.Tensor, torch.Tensor]]]] = {}

    def quantize(
        self, x: torch.Tensor, fmt: Format | int, group_size: int | None = None, axis: str | None = None, *,
        centre: torch.Tensor | None = None, **options: Any,
    ) -> QTensor:  # fmt: skip
        """Quantize ``x`` in format ``fmt``: this backend's kernel for the format, else the format's reference.

        Parameters
        ----------
        x : torch.Tensor
            ``(batch, kv_heads, tokens, head_dim)``. For a format grouped along ``"channel"`` ``tokens``
            must be a multiple of its ``group_size``; along ``"token"`` ``head_dim`` must be.
        fmt : Format
            What to store (:class:`~kvpolicy.formats.MinMax`, :class:`~kvpolicy.formats.Codebook`, or a
            registered format): it carries every parameter (bits, group, axis, fit, metadata dtype).
        centre : torch.Tensor, optional
            ``(batch, kv_heads, 1, head_dim)``: an offset shared by a stream's blocks, for formats whose
            :attr:`~kvpolicy.formats.base.Format.centred` says they take one.
        group_size, axis, options
            The positional shortcut ``quantize(x, bits, group_size, axis, meta_dtype=..., scheme=...,
            fit=...)`` builds the format (:func:`kvpolicy.formats.from_arguments`).

        Raises
        ------
        MetadataOverflowError
            If finite ``x`` would be stored with non-finite metadata. The built-in formats check
            (:func:`check_metadata`) wherever finite input can overflow their metadata dtype.
        """
        if not isinstance(fmt, Format):
            fmt = formats.from_arguments(self.name, fmt, group_size, axis, **options)
        elif group_size is not None or axis is not None or options:
            raise TypeError("Backend.quantize(x, fmt): the format carries every parameter; pass nothing else")
        kernel = self.quantizers.get(type(fmt))
        return fmt.quantize(x, self, centre) if kernel is None else kernel(self, x, fmt, centre)

    def dequantize(self, q: QTensor) -> torch.Tensor:
        """Return ``(batch, kv_heads, tokens, head_dim)`` in ``q.dtype`` (a kernel, else the block's own)."""
        kernel = self.dequantizers.get(type(q))
        return q.dequantize() if kernel is None else kernel(self, q)

    def cat(self, blocks: list[QTensor]) -> QTensor:
        """Concatenate containers of the same configuration along the token axis (the block's ``cat``)."""
        return type(blocks[0]).cat(blocks)

    def block_state(self, q: QTensor) -> dict:
        """``q`` as JSON values and tensors, for a saved cache (:meth:`kvpolicy.CompressedCache.save`).

        Optional: blocks that name no saved layout (:attr:`QTensor.layouts`) cannot be saved (the cache
        says so before writing)."""
        if not type(q).layouts:
            raise NotImplementedError(f"backend {self.name!r} cannot save its quantized blocks (no block_state())")
        return q.state()

    def load_block(self, state: dict, fmt: Format | None = None) -> QTensor:
        """The block :meth:`block_state` described (:func:`kvpolicy.formats.load_block`; ``fmt``: the
        format of the stream it loads into)."""
        return formats.load_block(state, fmt)

    def attend(
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of decode queries over a quantized segment, in mergeable (out, log-sum-exp) form.

        This backend's kernel for the pair of block classes (:attr:`attention_kernels`), else
        :meth:`attend_without_kernel` (here: the reference, which dequantizes). Results over disjoint
        key sets merge exactly: ``lse = logaddexp(lse_a, lse_b)``,
        ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.

        Parameters
        ----------
        query : torch.Tensor
            ``(batch, kv_heads, q, head_dim)``: the queries that share each kv head (grouped-query
            heads and query tokens flattened into ``q``).
        keys, values : QTensor
            ``(batch, kv_heads, n, head_dim)`` each, the same ``n`` tokens.
        scale : float
            Multiplies ``query @ keys.T`` (usually ``head_dim ** -0.5``).

        Returns
        -------
        out : torch.Tensor
            ``(batch, kv_heads, q, head_dim_v)`` float32, ``softmax(scores) @ values`` over these tokens.
        lse : torch.Tensor
            ``(batch, kv_heads, q)`` float32, ``logsumexp(scores)`` over these tokens.
        """
        kernel = self.attention_kernels.get((type(keys), type(values)))
        if kernel is not None:
            return kernel(self, query, keys, values, scale)
        return self.attend_without_kernel(query, keys, values, scale)

    def attend_without_kernel(
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attend` for blocks without a kernel: the reference (:func:`reference_attend` over this
        backend's :meth:`dequantize`). Backends that refuse such blocks override it."""
        return reference_attend(query, keys, values, scale, self.dequantize)

    def attend_biased(
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attend` with ``bias`` ``(batch, kv_heads, q, n)`` added to the scaled scores of each token
        before the softmax (a transform that holds part of each key outside the codes scores that part
        itself, :meth:`kvpolicy.transforms.base.Basis.score_term`, and the fused path hands it in here).

        Here: the reference, over this backend's :meth:`dequantize` (one segment's keys and values are
        decoded in float32 for the step; nothing is kept). The ``torch`` backend scores the blocks group by
        group, and the ``cpu`` backend adds the bias in its kernel.
        """
        if bias is None:
            return self.attend(query, keys, values, scale)
        return reference_attend(query, keys, values, scale, self.dequantize, bias)

    def check(self, *, bits: int, group_size: int, axis: str, role: str = "") -> None:
        """Raise :class:`ConfigError` if this backend cannot do what is asked.

        Parameters
        ----------
        bits, group_size, axis
            The requested configuration.
        role : str
            ``"key"`` or ``"value"``, used to name the parameter in the message.
        """
        caps = self.capabilities
        prefix = f"{role}_" if role else ""
        if bits not in caps.bits:
            raise ConfigError(
                f"backend {self.name!r} does not support bits={bits!r}; it supports bits in {list(caps.bits)}"
            )
        if axis not in caps.axes:
            raise ConfigError(
                f"backend {self.name!r} does not support {prefix}axis={axis!r}; it supports {list(caps.axes)}"
            )
        mult = caps.group_size_multiple
        if group_size % mult != 0:
            raise ConfigError(
                f"backend {self.name!r} needs group_size to be a multiple of {mult}; got "
                f"{prefix}group_size={group_size}"
            )

    @classmethod
    def names(cls) -> set[str]:
        """This backend's name and those of the backends it derives from: a format naming one of them in
        ``Format.backends`` is served here (a subclass of ``torch`` serves what ``torch`` serves)."""
        return {c.__dict__["name"] for c in cls.__mro__ if isinstance(c.__dict__.get("name"), str)}

    def check_format(self, fmt: Format, role: str = "") -> None:
        """Raise :class:`ConfigError` unless this backend serves ``role`` tensors (``"key"``, ``"value"``) in
        ``fmt``: a format its capabilities name or that names it, of a width they list, a metadata dtype they
        accept, and, for a grouped format, an axis and group size :meth:`check` takes. Backends refuse the
        options of a format their kernels do not read by extending it.
        """
        caps = self.capabilities
        prefix = f"{role}_" if role else ""
        if fmt.name not in caps.formats and not self.names().intersection(fmt.backends):
            raise ConfigError(
                f"backend {self.name!r} does not serve {prefix}scheme={fmt.name!r}; it serves {list(caps.formats)} "
                "and the formats that name it"
            )
        if fmt.grouped:
            self.check(bits=fmt.bits, group_size=fmt.group_size, axis=fmt.axis, role=role)  # type: ignore[arg-type]
        elif fmt.bits not in caps.bits:
            raise ConfigError(
                f"backend {self.name!r} does not support {prefix}bits={fmt.bits!r} with scheme={fmt.name!r}; it "
                f"supports bits in {list(caps.bits)}"
            )
        self.check_meta_dtype(fmt.meta_dtype)

    def serves(self, fmt: Format, role: str = "") -> bool:
        """Whether :meth:`check_format` accepts ``fmt`` for ``role``."""
        try:
            self.check_format(fmt, role)
        except ConfigError:
            return False
        return True

    def check_meta_dtype(self, meta_dtype: str) -> None:
        """Raise :class:`ConfigError` if this backend cannot store metadata as ``meta_dtype`` asks."""
        supported = self.capabilities.meta_dtypes
        if meta_dtype not in supported:
            raise ConfigError(
                f"backend {self.name!r} does not support meta_dtype={meta_dtype!r}; it supports {list(supported)}"
            )

    def check_tensor(self, x: torch.Tensor) -> None:
        """Raise :class:`ConfigError` if the device or dtype of ``x`` is not supported."""
        caps = self.capabilities
        if x.device.type not in caps.devices:
            raise ConfigError(
                f"backend {self.name!r} does not run on device {x.device.type!r}; it supports {list(caps.devices)}"
            )
        if x.dtype not in caps.dtypes:
            raise ConfigError(
                f"backend {self.name!r} does not accept dtype {x.dtype}; it supports {[str(d) for d in caps.dtypes]}"
            )

    @classmethod
    def usability(cls) -> Usability:
        """Whether this backend can run here, and if not what it needs; ``kvpolicy list`` shows it.

        This default constructs the backend: usable when construction succeeds, else the
        :class:`~kvpolicy.errors.ConfigError` (a missing package's
        :class:`~kvpolicy.errors.MissingDependencyError` included) is the note. A backend whose construction
        builds or loads something, or that runs on some devices only, overrides it with checks that build and
        load nothing (:mod:`kvpolicy.backends._optional` has the common ones), so that ``kvpolicy list`` stays
        fast.
        """
        try:
            cls()
        except ConfigError as exc:
            return Usability(False, str(exc))
        except Exception as exc:  # a plugin's own failure: reported, not raised
            return Usability(False, f"constructing it raised {type(exc).__name__}: {exc}")
        return Usability(True)

    def __repr__(self) -> str:
        return repr(self.name)
