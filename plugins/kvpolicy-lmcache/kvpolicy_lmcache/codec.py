"""The chunk codec: a chunk's groups to one payload and back, in kvpolicy's formats.

An LMCache chunk is one or more *groups* (the kernel groups of an object group: hybrid models have
several, of different shapes and dtypes). A group shaped ``[2, layers, tokens, kv_heads × head_dim]``
(keys and values stacked) in bfloat16, float16 or float32 is *coded*: each role is viewed as ``(layers,
kv_heads, tokens, head_dim)``, rotated, and quantized in its format (one block per role, the layers as
the block's batch rows), except the first and last few tokens of the chunk (``keep_first``,
``keep_last``; by default what the preset keeps at full precision by position: its attention sink and
recent window), which are kept verbatim in the chunk's dtype. Any other group (a single plane such as
MLA's latents, an integer dtype, an empty group) is stored verbatim. :meth:`ChunkCodec.plan` says which,
for a layout, and why.

Payloads are laid out as :mod:`kvpolicy_lmcache.payload` describes; their size is a function of the
layout alone (:meth:`ChunkCodec.payload_size`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvpolicy.errors import ConfigError, NonFiniteError, did_you_mean
from kvpolicy.transforms.base import cast_clamped
from kvpolicy_lmcache import fast, kvparts, payload
from kvpolicy_lmcache.kvparts import Parts, Template

#: chunk dtypes whose K/V groups are coded
CODED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: vector sizes tried, largest first, when the adapter's config names no head dim: 64 never lets a vector
#: span two heads of a model whose head dim is a multiple of 64 (64, 128, 256)
INFERRED_HEAD_DIMS = (64, 32, 16, 8)
#: the preset of a codec configured without one
DEFAULT_PRESET = "kvpolicy-3bit"
#: how groups are encoded and decoded: ``"auto"`` compiles codebook formats behind a block Hadamard rotation
#: (:mod:`kvpolicy_lmcache.fast`) and takes the reference path for anything else; ``"reference"`` always
#: takes kvpolicy's own quantizer and the transform's matrix (:mod:`kvpolicy_lmcache.kvparts`)
KERNELS = ("auto", "reference")
#: the most tokens of a chunk's start or end a codec keeps verbatim (LMCache's chunks hold 256)
MAX_KEPT = 4096


@dataclass(frozen=True)
class GroupPlan:
    """How one group of a layout is stored.

    Attributes
    ----------
    shape : tuple of int
        The group's shape (``[2, layers, tokens, hidden]`` for a K/V group).
    dtype : torch.dtype
        Its dtype.
    mode : {"coded", "raw"}
        Coded in the codec's formats, or stored verbatim.
    why : str
        Why a group is stored verbatim (empty for a coded one).
    head_dim : int or None
        The channels of each stored vector (coded groups).
    templates : tuple of Template
        The keys' and the values' block templates (coded groups).
    rotation : fast.Rotation or None
        The rotation the compiled path applies (coded groups it serves; ``None``: the reference path).
    first, last : int
        How many of the group's first and last tokens are kept verbatim (coded groups); the templates
        hold the tokens between them.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    mode: str
    why: str = ""
    head_dim: int | None = None
    templates: tuple[Template, ...] = ()
    rotation: fast.Rotation | None = field(default=None, compare=False)
    first: int = 0
    last: int = 0

    @property
    def kept_shape(self) -> tuple[int, ...]:
        """Shape of the section of tokens kept verbatim (coded groups): ``[2, layers, first + last, hidden]``."""
        return (2, self.shape[1], self.first + self.last, self.shape[3])

    @property
    def coded_tokens(self) -> int:
        """Tokens of the coded blocks (coded groups)."""
        return self.shape[2] - self.first - self.last

    @property
    def nbytes(self) -> int:
        """Bytes of its sections, padding included."""
        if self.mode == "raw":
            return payload.pad(_numel(self.shape) * self.dtype.itemsize)
        kept = payload.pad(_numel(self.kept_shape) * self.dtype.itemsize) if self.first + self.last else 0
        return kept + sum(payload.pad(s.nbytes) for t in self.templates for s in t.sections)

    def describe(self) -> dict[str, Any]:
        """The group as the payload header records it (the tokens kept verbatim only where some are)."""
        out = {
            "shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch."), "mode": self.mode,
            "head_dim": self.head_dim,
        }  # fmt: skip
        if self.first + self.last:
            out["verbatim_tokens"] = [self.first, self.last]
        return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass(frozen=True)
class ChunkCodec:
    """kvpolicy's formats as a codec for LMCache chunks (see the module docstring).

    Parameters
    ----------
    preset : str
        The kvpolicy preset whose formats and rotation the codec uses (its action's last tier; no token
        selection): ``"kvpolicy-3bit"`` (3-bit centred codebook keys, 2-bit codebook values, one-byte
        scales, Hadamard rotation), ``"kvpolicy-3.5bit"``, ``"kvpolicy-4bit"``, or any registered preset
        that quantizes every token on its own.
    seed : int, optional
        The rotation's seed (the preset's parameter; default: the preset's).
    norm_bits : {8, 16}, optional
        Width of each vector's scale (the preset's parameter; default: the preset's).
    key_bits, value_bits : int, optional
        Code widths of keys and values replacing the preset's.
    head_dim : int, optional
        The model's head dim: each stored vector is one head of one token. Default: each group's vectors
        are the largest of 64, 32, 16, 8 channels that divides its hidden size (part of a head for models
        with 128- or 256-channel heads: each part keeps its own scale, which costs ``8 / 64`` bits per
        element instead of ``8 / 128``; give ``head_dim`` for vectors of whole heads).
    keep_first, keep_last : int, optional
        How many of each chunk's first and last tokens are stored verbatim, in the chunk's dtype, instead of
        coded (default: the preset's full-precision share, :func:`kvparts.kept_tokens`). The first tokens
        of a prompt's first chunk are its attention sinks, and the last tokens of the chunk a decode
        continues from are the most recent ones, which the preset in memory also keeps at full precision;
        a chunk carries no positions, so every chunk keeps them. A chunk of fewer tokens keeps its first
        ``keep_first`` and then as many of its last ones as it has left. ``0, 0``: every token coded.
    kernel : {"auto", "reference"}
        How groups are encoded and decoded (:data:`KERNELS`); payloads are the same either way.

    Raises
    ------
    ConfigError
        A parameter of the wrong type or value, or a preset the codec cannot serve (naming why).
    """

    preset: str = DEFAULT_PRESET
    seed: int | None = None
    norm_bits: int | None = None
    key_bits: int | None = None
    value_bits: int | None = None
    head_dim: int | None = None
    keep_first: int | None = None
    keep_last: int | None = None
    kernel: str = "auto"
    parts: Parts = field(init=False, repr=False, compare=False)
    #: the first and last tokens of each chunk kept verbatim (``keep_first``, ``keep_last`` or the preset's)
    kept: tuple[int, int] = field(init=False, repr=False, compare=False)

    #: the adapter-config keys :meth:`from_config` accepts besides these parameters (LMCache's own)
    LMCACHE_KEYS: ClassVar[tuple[str, ...]] = ("max_workers",)

    def __post_init__(self) -> None:
        if not isinstance(self.preset, str) or not self.preset:
            raise ConfigError(f"kvpolicy codec: preset must be a preset's name; got preset={self.preset!r}")
        for name in ("seed", "norm_bits", "key_bits", "value_bits", "head_dim", "keep_first", "keep_last"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"kvpolicy codec: {name} must be an integer; got {name}={value!r}")
        if self.kernel not in KERNELS:
            raise ConfigError(f"kvpolicy codec: kernel must be one of {list(KERNELS)}; got kernel={self.kernel!r}")
        if self.head_dim is not None and self.head_dim < 1:
            raise ConfigError(f"kvpolicy codec: head_dim must be >= 1; got head_dim={self.head_dim}")
        for name in ("keep_first", "keep_last"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_KEPT:
                raise ConfigError(f"kvpolicy codec: {name} must be in [0, {MAX_KEPT}]; got {name}={value}")
        overrides = {n: getattr(self, n) for n in ("seed", "norm_bits") if getattr(self, n) is not None}
        parts = kvparts.resolve(self.preset, overrides, self.key_bits, self.value_bits)
        if self.head_dim is not None and (why := parts.check_head_dim(self.head_dim)):
            raise ConfigError(f"kvpolicy codec: head_dim={self.head_dim} cannot be served: {why}")
        object.__setattr__(self, "parts", parts)
        first, last = kvparts.kept_tokens(self.preset)
        object.__setattr__(self, "kept", (
            first if self.keep_first is None else self.keep_first, last if self.keep_last is None else self.keep_last
        ))  # fmt: skip

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ChunkCodec:
        """The codec an adapter's ``"serde"`` entry describes (without its ``"type"``; LMCache's own
        keys, :attr:`LMCACHE_KEYS`, are ignored here).

        Raises
        ------
        ConfigError
            An unknown key (with the closest known one), or a bad value.
        """
        if not isinstance(config, dict):
            raise ConfigError(f"kvpolicy codec: the serde config must be a JSON object; got {config!r:.80}")
        known = ("preset", "seed", "norm_bits", "key_bits", "value_bits", "head_dim", "keep_first", "keep_last",
                 "kernel")  # fmt: skip
        for name in config:
            if name not in known and name not in cls.LMCACHE_KEYS:
                raise ConfigError(
                    f"kvpolicy codec: unknown serde key {name!r}; the keys are {['type', *known, *cls.LMCACHE_KEYS]}"
                    f"{did_you_mean(name, known)}"
                )
        return cls(**{k: v for k, v in config.items() if k in known})

    def describe(self) -> dict[str, Any]:
        """The codec as the payload header records it: its preset, its head dim setting, the formats and
        rotation in use, and the tokens kept verbatim (only where some are)."""
        out = {"preset": self.preset, "head_dim": self.head_dim, **self.parts.describe()}
        if any(self.kept):
            out["verbatim_tokens"] = list(self.kept)
        return out

    # ------------------------------------------------------------------ planning
    def plan(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> tuple[GroupPlan, ...]:
        """How each group of a layout is stored (see :class:`GroupPlan`).

        Raises
        ------
        ConfigError
            If the configured ``head_dim`` does not divide a K/V group's hidden size.
        """
        if len(shapes) != len(dtypes):
            raise ConfigError(f"kvpolicy codec: a layout of {len(shapes)} shapes and {len(dtypes)} dtypes")
        return self._plan(tuple(tuple(int(s) for s in shape) for shape in shapes), tuple(dtypes))

    @functools.lru_cache(maxsize=64)  # noqa: B019 - frozen, hashable; a handful of layouts per process
    def _plan(self, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[torch.dtype, ...]) -> tuple[GroupPlan, ...]:
        return tuple(self._group(shape, dtype) for shape, dtype in zip(shapes, dtypes, strict=True))

    def _group(self, shape: tuple[int, ...], dtype: torch.dtype) -> GroupPlan:
        """The one place where a group is coded or stored verbatim."""
        if len(shape) != 4 or shape[0] != 2:
            return GroupPlan(shape, dtype, "raw", f"not [2, layers, tokens, hidden] (K and V stacked): {list(shape)}")
        if dtype not in CODED_DTYPES:
            return GroupPlan(shape, dtype, "raw", f"dtype {dtype} is not one of bfloat16, float16, float32")
        _, layers, tokens, hidden = shape
        if layers * tokens * hidden == 0:
            return GroupPlan(shape, dtype, "raw", "it is empty")
        head_dim = self.head_dim if self.head_dim is not None else self._infer_head_dim(hidden)
        if head_dim is None:
            return GroupPlan(
                shape, dtype, "raw", f"no head dim the formats serve ({list(INFERRED_HEAD_DIMS)}) divides {hidden}"
            )
        if hidden % head_dim:
            raise ConfigError(
                f"kvpolicy codec: head_dim={head_dim} does not divide the hidden size {hidden} of a chunk group of "
                f"shape {list(shape)} (kv_heads × head_dim); set head_dim to the model's, or leave it out"
            )
        first = min(self.kept[0], tokens)
        last = min(self.kept[1], tokens - first)
        coded = tokens - first - last
        templates: tuple[Template, ...] = ()
        if coded:
            block = (layers, hidden // head_dim, coded, head_dim)
            templates = tuple(kvparts.template(kvparts.for_dtype(f, dtype), block) for f in self._formats())
        rotation = None
        if self.kernel == "auto" and fast.serves(self.parts.keys, self.parts.values):
            rotation = fast.rotation(self.parts.transform, head_dim)
        return GroupPlan(shape, dtype, "coded", "", head_dim, templates, rotation, first, last)

    def _infer_head_dim(self, hidden: int) -> int | None:
        for d in INFERRED_HEAD_DIMS:
            if hidden % d == 0 and self.parts.check_head_dim(d) is None:
                return d
        return None

    def _formats(self) -> tuple:
        return (self.parts.keys, self.parts.values)

    def header(self, plan: tuple[GroupPlan, ...], key: Any) -> bytes:
        """The JSON header of a payload of ``plan`` for chunk ``key`` (``None``: a placeholder of the same
        length, for sizes)."""
        digest = "0" * 32 if key is None else payload.key_digest(key)
        return payload.header_bytes({"codec": self.describe(), "groups": [g.describe() for g in plan], "key": digest})

    def payload_size(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> int:
        """The exact size in bytes of the payload of every chunk of this layout (prefix, header, padding
        and sections)."""
        plan = self.plan(shapes, dtypes)
        return payload.body_offset(len(self.header(plan, None))) + sum(g.nbytes for g in plan)

    # ------------------------------------------------------------------ encoding
    def encode(self, groups: Sequence[torch.Tensor], out: torch.Tensor, key: Any) -> int:
        """Write the payload of a chunk's ``groups`` into ``out``; returns its size.

        Parameters
        ----------
        groups : sequence of torch.Tensor
            The chunk's groups, in layout order (e.g. one ``[2, layers, tokens, hidden]`` tensor).
        out : torch.Tensor
            A 1-D ``uint8`` buffer of at least :meth:`payload_size` bytes.
        key : ObjectKey
            The chunk's key (recorded in the header, checked by :meth:`decode`).

        Raises
        ------
        ValueError
            If ``out`` is too small, or a coded group holds NaN or Inf (kvpolicy's quantizer refuses it).
        """
        plan = self.plan([tuple(g.shape) for g in groups], [g.dtype for g in groups])
        head = self.header(plan, key)
        start = payload.body_offset(len(head))
        total = start + sum(g.nbytes for g in plan)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
            raise ValueError(
                f"kvpolicy codec: chunk {payload.describe_key(key)}: the output buffer holds {out.numel()} "
                f"{out.dtype} elements; the payload needs {total} bytes"
            )
        buf = out[:total]
        buf.zero_()
        buf[payload.PREFIX.size : payload.PREFIX.size + len(head)].copy_(
            torch.frombuffer(bytearray(head), dtype=torch.uint8)
        )
        offset = start
        for g, tensor in zip(plan, groups, strict=True):
            for section in self._encode_group(g, tensor):
                n = section.numel()
                buf[offset : offset + n].copy_(section)
                offset += payload.pad(n)
        view = memoryview(buf.numpy())
        crc = payload.crc(view[payload.PREFIX.size : total])
        buf[: payload.PREFIX.size].copy_(
            torch.frombuffer(bytearray(payload.prefix(len(head), total, crc)), dtype=torch.uint8)
        )
        return total

    def _encode_group(self, g: GroupPlan, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The sections of one group as flat ``uint8`` tensors, in the order they are written."""
        if g.mode == "raw":
            return [_bytes(tensor)]
        _, layers, tokens, hidden = g.shape
        head_dim = g.head_dim
        assert head_dim is not None
        out = []
        if g.first + g.last:
            kept = torch.cat([tensor[:, :, : g.first], tensor[:, :, tokens - g.last :]], dim=2)
            if not bool(torch.isfinite(kept).all()):
                raise NonFiniteError("kvpolicy codec: tokens holding NaN or Inf reached the codec")
            out.append(_bytes(kept))
        if not g.templates:  # every token kept verbatim
            return out
        coded = tensor[:, :, g.first : tokens - g.last]
        for role, (fmt, tmpl) in enumerate(zip(self._formats(), g.templates, strict=True)):
            x = coded[role].reshape(layers, g.coded_tokens, hidden // head_dim, head_dim)
            if g.rotation is not None:
                tensors = fast.encode(kvparts.for_dtype(fmt, g.dtype), g.rotation, x, g.dtype)
            else:
                x = self.parts.transform.forward(x.permute(0, 2, 1, 3).float())
                tensors = kvparts.quantize(kvparts.for_dtype(fmt, g.dtype), x)
            for s in tmpl.sections:
                t = tensors[s.name]
                if t.dtype != s.dtype or tuple(t.shape) != s.shape:  # a format storing data-dependent shapes
                    raise RuntimeError(
                        f"kvpolicy codec: format {fmt!r} stored {s.name} as {t.dtype} {tuple(t.shape)}; its template "
                        f"says {s.dtype} {s.shape} (a payload's size must depend on its layout alone)"
                    )
                out.append(_bytes(t))
        return out

    # ------------------------------------------------------------------ decoding
    def decode(self, buf: torch.Tensor, groups: Sequence[torch.Tensor], key: Any) -> None:
        """Fill a chunk's ``groups`` from the payload in ``buf``, or refuse it before writing anything.

        Parameters
        ----------
        buf : torch.Tensor
            A 1-D ``uint8`` tensor starting with the payload (longer is allowed: a buffer sized for the
            layout, whatever follows the payload is ignored).
        groups : sequence of torch.Tensor
            The destination groups (their shapes and dtypes are the layout the payload must have).
        key : ObjectKey
            The chunk's key (the payload must have been written for it).

        Raises
        ------
        PayloadError
            A payload of another version, codec, layout or key, a truncated or damaged one, one whose
            blocks kvpolicy's checks refuse, or one that decodes to NaN or Inf (no finite chunk does: a
            payload crafted with scales out of the destination's range); the message names the chunk key
            and what differs.
        """
        name = payload.describe_key(key)
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise payload.PayloadError(name, f"it arrived as a {buf.dtype} tensor of shape {tuple(buf.shape)}")
        plan = self.plan([tuple(g.shape) for g in groups], [g.dtype for g in groups])
        head = self.header(plan, key)
        total = payload.body_offset(len(head)) + sum(g.nbytes for g in plan)
        payload.check(memoryview(buf.numpy()), head, total, name)
        offset = payload.body_offset(len(head))
        decoded = []
        for i, (g, dst) in enumerate(zip(plan, groups, strict=True)):
            # every group is read, checked and decoded before any destination is written
            parts, offset = self._read_group(g, buf, offset, f"group {i}", name)
            decoded.append(self._decode_group(g, parts, dst.dtype, f"group {i}", name))
        for values, dst in zip(decoded, groups, strict=True):
            for role, v in enumerate(values):
                (dst if len(values) == 1 else dst[role]).copy_(v)

    def _read_group(self, g: GroupPlan, buf: torch.Tensor, offset: int, where: str, name: str) -> tuple[list, int]:
        if g.mode == "raw":
            n = _numel(g.shape) * g.dtype.itemsize
            return [_typed(buf, offset, g.dtype, g.shape)], offset + payload.pad(n)
        blocks: list = []
        if g.first + g.last:
            kept = _typed(buf, offset, g.dtype, g.kept_shape)
            if not bool(torch.isfinite(kept).all()):
                raise payload.PayloadError(name, f"the tokens {where} keeps verbatim hold NaN or Inf")
            blocks.append(kept)
            offset += payload.pad(_numel(g.kept_shape) * g.dtype.itemsize)
        if not g.templates:
            return blocks, offset
        for role, (fmt, tmpl) in enumerate(zip(self._formats(), g.templates, strict=True)):
            tensors = {}
            for s in tmpl.sections:
                tensors[s.name] = _typed(buf, offset, s.dtype, s.shape)
                offset += payload.pad(s.nbytes)
            try:
                blocks.append(kvparts.block(kvparts.for_dtype(fmt, g.dtype), tmpl, tensors))
            except ValueError as exc:
                raise payload.PayloadError(name, f"the {('keys', 'values')[role]} of {where}: {exc}") from None
        return blocks, offset

    def _decode_group(self, g: GroupPlan, parts: list, dtype: torch.dtype, where: str, name: str) -> list:
        """A group's contents in ``dtype``: the raw group, or the keys and the values of a coded one."""
        if g.mode == "raw":
            return [parts[0]]
        _, layers, _, hidden = g.shape
        assert g.head_dim is not None
        kept = parts[0] if g.first + g.last else None
        blocks = parts[1:] if kept is not None else parts
        if not blocks:  # every token kept verbatim
            assert kept is not None
            return [kept[0], kept[1]]
        out = []
        for role, block in enumerate(blocks):
            x: torch.Tensor | None
            if g.rotation is not None:  # bfloat16 comes back rounded and checked, other dtypes in float32
                x = fast.decode(block, g.rotation, dtype)
            else:  # (layers, heads, tokens, head_dim) back to (layers, tokens, heads, head_dim)
                x = self.parts.transform.inverse(block.dequantize().float()).permute(0, 2, 1, 3)
            if x is not None and not (g.rotation is not None and dtype == torch.bfloat16):
                # a float16 reconstruction a rounding beyond 65504 is clamped, not turned into infinity
                # (bfloat16 has float32's range)
                x = cast_clamped(x, dtype) if dtype == torch.float16 else x.to(dtype)
                if not bool(torch.isfinite(x).all()):
                    x = None
            if x is None:
                what = ("keys", "values")[role]
                raise payload.PayloadError(name, f"the {what} of {where} decode to NaN or Inf (scales out of range)")
            x = x.reshape(layers, g.coded_tokens, hidden)
            if kept is not None:
                x = torch.cat([kept[role, :, : g.first], x, kept[role, :, g.first :]], dim=1)
            out.append(x)
        return out

    def __repr__(self) -> str:
        given = [f"{n}={getattr(self, n)!r}" for n in ("seed", "norm_bits", "key_bits", "value_bits", "head_dim")
                 if getattr(self, n) is not None]  # fmt: skip
        given.append(f"keep_first={self.kept[0]}, keep_last={self.kept[1]}")
        if self.kernel != "auto":
            given.append(f"kernel={self.kernel!r}")
        p = self.parts
        return (
            f"ChunkCodec(preset={self.preset!r}{''.join(', ' + g for g in given)}; keys={p.keys!r}, "
            f"values={p.values!r}, transform={p.transform!r})"
        )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat ``uint8`` tensor (a view where ``t`` is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _typed(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The ``dtype`` tensor of ``shape`` at byte ``offset`` of ``buf`` (a view where aligned, else a copy)."""
    raw = buf[offset : offset + _numel(shape) * dtype.itemsize]
    try:
        return raw.view(dtype).view(tuple(shape))
    except RuntimeError:
        return raw.clone().view(dtype).view(tuple(shape))
