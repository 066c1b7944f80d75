"""The ``cpu`` backend: the ``torch`` backend's storage with a C++ decode-attention kernel.

Quantize, dequantize, ``cat`` and the containers are the ``torch`` backend's, bit for bit. ``attend`` — the
quantized part of :mod:`kvpolicy.fused`'s decode attention — runs a hand-written C++ kernel
(:mod:`kvpolicy.kernels.cpu_attention`) that reads the packed codes inside the score and value reductions:
for min-max blocks (:class:`~kvpolicy.formats.packed.PackedTensor`), per key group, scores are
``(q ⊙ s) · codes + q · z``; per token, values add ``(p · s) · codes`` and ``p · z``; online softmax; float32
accumulation; OpenMP over (batch, kv head, token split).

It reads as well any block of *scaled table codes* (:class:`~kvpolicy.formats.codebook.ScaledBlock`: one
scale per token, codes indexing the table its :meth:`~kvpolicy.formats.codebook.ScaledBlock.table` gives),
whatever format made it: a table of ``2**bits`` values, one code per channel (the codebook,
``Quantize(scheme="codebook")``), or of ``2**(4 · bits)`` points of four coordinates, one index per four
channels (a format a plugin registers names ``cpu`` in its ``backends`` to be read here). Keys score
``s_t · (q · T[codes_t])`` eight tokens at a time where AVX2 and FMA allow (tiles of :attr:`CpuBackend.tile`
tokens), values add ``(p · s_t) · T[codes_t]``. Any key format goes with any value format.

The kernel covers: **keys** min-max grouped per channel (the default, KIVI's) or scaled table codes;
**values** min-max grouped per token or scaled table codes; **2, 3 or 4 bits** (tables of points: 2 or 3;
any key/value pair), with float16, bfloat16 or float32 metadata (every ``meta_dtype``, each role its own),
and scales as one-byte codes (``norm_bits=8``), which the kernel reads as they are stored: per (batch, head)
it builds the 256 scales their codes decode to, by the formula and table of
:mod:`kvpolicy.formats.scale_codes`. Other layouts or widths are refused when a cache is built
(:meth:`CpuBackend.check_format`), not run some other way: use ``backend="torch"`` for them. Nothing falls
back to the ``torch`` computation at decode time.
"""

from __future__ import annotations

import os
import shutil

import torch

from kvpolicy.backends._optional import ninja
from kvpolicy.backends.base import META_DTYPES, Capabilities, QTensor, Usability
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.derived import Derived
from kvpolicy.errors import ConfigError
from kvpolicy.formats.base import META_TORCH_DTYPES, Format
from kvpolicy.formats.packed import PackedTensor, _inner_contiguous, per_head_views
from kvpolicy.formats.scale_codes import octave_steps
from kvpolicy.kernels import cpu_attention

#: the grouping axis the kernel reads, by role
AXIS_BY_ROLE = {"key": "channel", "value": "token"}
#: tokens per tile of codebook keys (:attr:`CpuBackend.tile`)
CODEBOOK_TILE = 64
#: channels per code index -> the widths the kernel reads blocks of scaled table codes at
POINT_BITS = {1: (2, 3, 4), 4: (2, 3)}
#: the attributes a block keeps its checked kernel arguments under, ``PREPARED + "_" + role``
#: (:meth:`CpuBackend.prepared`)
PREPARED = "_cpu_kernel_args"
#: the most splits choices a backend keeps (one per tile count of a segment read, and thread count)
SPLITS_KEPT = 256


class CpuBackend(TorchBackend):
    """``torch`` storage plus a compiled C++ ``attend`` (see the module docstring).

    Raises
    ------
    ConfigError
        At construction, if the kernel cannot be built (no C++ compiler, no ``ninja``, a failing
        build); the first construction in an environment compiles it (tens of seconds).
    """

    name = "cpu"
    capabilities = Capabilities(
        bits=(2, 3, 4),
        axes=("channel", "token"),
        group_size_multiple=4,
        devices=("cpu",),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        meta_dtypes=META_DTYPES,
    )

    @classmethod
    def usability(cls) -> Usability:
        """Usable when its kernel is built, or when a C++ compiler (``$CXX``, else ``c++``) and ``ninja`` can
        build it; builds and loads nothing."""
        try:
            library = cpu_attention.library_path(cpu_attention.extension_name(cpu_attention.SOURCE.read_text()))
            if cpu_attention.is_verified(library, cpu_attention.record_path(library), warn=False):
                return Usability(True, "CPU tensors; its C++ kernel is built")
        except (OSError, ConfigError):
            pass
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            return Usability(False, f"needs a C++ compiler with OpenMP to build its kernel ({cxx!r} is not on "
                                    "PATH; e.g. apt install g++, or set CXX)")  # fmt: skip
        if not ninja():
            return Usability(False, "needs ninja to build its kernel: pip install ninja")
        return Usability(True, "CPU tensors; builds its C++ kernel on first use (under a minute)")

    def __init__(self) -> None:
        self._kernel = cpu_attention.load()
        #: token splits per (batch, kv head); ``None``: :func:`cpu_attention.default_splits`
        self.splits: int | None = None
        #: tokens per tile of codebook keys (min-max keys: their group); one online-softmax step each
        self.tile: int = CODEBOOK_TILE
        #: the ``(device type, dtype)`` of the last query :meth:`~Backend.check_tensor` accepted
        self._query_ok: tuple[str, torch.dtype] | None = None
        #: the splits :func:`cpu_attention.default_splits` chose by ``(programs, tiles, threads)``, in eager calls
        self._splits_for: dict[tuple[int, int, int], int] = {}

    # the loaded kernel is a module: copies of a cache share it, pickles load it again
    def __deepcopy__(self, memo: dict) -> CpuBackend:
        return self

    def __getstate__(self) -> dict:
        return {"splits": self.splits, "tile": self.tile}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self.splits = state["splits"]
        self.tile = state.get("tile", CODEBOOK_TILE)

    def check(self, *, bits: int, group_size: int, axis: str, role: str = "") -> None:
        """:meth:`Backend.check`, and keys must be grouped per channel, values per token."""
        super().check(bits=bits, group_size=group_size, axis=axis, role=role)
        want = AXIS_BY_ROLE.get(role)
        if want is not None and axis != want:
            raise ConfigError(
                f"backend 'cpu' reads {role}s grouped along {want!r} only; got {role}_axis={axis!r} "
                "(use backend='torch' for other layouts)"
            )

    @classmethod
    def names(cls) -> set[str]:
        """``{"cpu"}``: the kernel reads the formats that name ``cpu``, not every one ``torch`` serves."""
        return {"cpu"}

    def check_format(self, fmt: Format, role: str = "") -> None:
        """:meth:`Backend.check_format`, and a format without groups must store scaled table codes the kernel
        reads: a :class:`~kvpolicy.formats.codebook.ScaledBlock` of one code per channel, or one index per
        four channels at 2 or 3 bits."""
        super().check_format(fmt, role)
        if fmt.grouped:
            return
        from kvpolicy.formats.codebook import ScaledBlock

        dim = getattr(fmt, "point_dim", None)
        if not issubclass(fmt.block, ScaledBlock) or dim not in POINT_BITS or fmt.bits not in POINT_BITS[dim]:
            raise ConfigError(
                f"backend 'cpu' reads blocks of scaled table codes with one code per channel at bits "
                f"{list(POINT_BITS[1])}, or one index per four channels at bits {list(POINT_BITS[4])}; "
                f"{role + 's in ' if role else ''}{fmt} are not (use backend='torch')"
            )

    def _packed_args(self, q: PackedTensor, role: str) -> tuple:
        self.check(bits=q.bits, group_size=q.group_size, axis=q.axis, role=role)
        if q.codes.device.type != "cpu":
            raise ConfigError(f"backend 'cpu' runs on CPU tensors; got {role}s on {q.codes.device.type!r}")
        codes, scales, zeros = per_head_views(q)
        return (codes, scales, zeros, None, q.bits, q.group_size, None, None), None

    def _scaled_args(self, q: QTensor, role: str) -> tuple:
        """A block of scaled table codes: its kernel arguments, checked: codes, scales (or one-byte codes with
        their base) and its table (1-d: one code per channel; 2-d: four channels per index; the kernel tells
        them apart by the table's shape). The key group is ``None``: the tile of :attr:`tile` tokens, read at
        each call."""
        codes, scales, base = q.codes, q.scales, q.scale_base  # type: ignore[attr-defined]
        if codes.device.type != "cpu" or scales.device.type != "cpu":
            raise ConfigError(f"backend 'cpu' runs on CPU tensors; got {role}s on {codes.device.type!r}")
        b, h, n, d = q.shape
        bits = q.bits  # type: ignore[attr-defined]
        table = q.table() if any(bits in widths for widths in POINT_BITS.values()) else torch.empty(1 << bits)  # type: ignore[attr-defined]
        dim = 1 if table.dim() == 1 else table.shape[-1]
        want_table = (1 << bits,) if dim == 1 else (1 << (dim * bits), dim)
        if dim not in POINT_BITS or bits not in POINT_BITS[dim] or tuple(table.shape) != want_table:
            raise ConfigError(
                f"backend 'cpu' reads {role}s of scaled table codes with a table of {2**bits} values at bits "
                f"{list(POINT_BITS[1])}, or of 2**(4 * bits) points of 4 coordinates at bits {list(POINT_BITS[4])}; "
                f"got {type(q).__name__} at {bits} bits with a table of shape {tuple(table.shape)}"
            )
        want = (b, h, n, d * bits // 8)
        if codes.dtype != torch.uint8 or tuple(codes.shape) != want or (d * bits) % 8:
            raise ConfigError(
                f"backend 'cpu': {type(q).__name__} {role}s of shape {q.shape} at {bits} bits need uint8 codes of "
                f"shape {want}; got {codes.dtype} {tuple(codes.shape)}"
            )
        allowed = (*META_TORCH_DTYPES.values(), torch.uint8) if base is not None else META_TORCH_DTYPES.values()
        if scales.dtype not in allowed or tuple(scales.shape) != (b, h, n):
            raise ConfigError(
                f"backend 'cpu': {type(q).__name__} {role}s need one float16, bfloat16 or float32 scale per token "
                f"(or one-byte codes with their base), shape {(b, h, n)}; got {scales.dtype} {tuple(scales.shape)}"
            )
        if not _inner_contiguous(codes):
            codes = codes.contiguous()
        if not _inner_contiguous(scales):
            scales = scales.contiguous()
        if base is not None and not _inner_contiguous(base):  # one-byte codes: the kernel decodes them
            base = base.contiguous()
        group = None if role == "key" else 0
        # one-byte scale codes are decoded in the kernel, through the table of their own decoder
        steps = None if base is None else octave_steps("cpu")
        return (codes, scales, None, table.contiguous(), bits, group, base, steps), q.centre  # type: ignore[attr-defined]

    def _kernel_args(self, q: QTensor, role: str) -> tuple[tuple, torch.Tensor | None]:
        """``(codes, scales, minimums or None, table or None, bits, group, base or None, steps or None)`` of one
        role's block as the kernel takes them (``group``: the key group or the value group; ``None`` for a scaled
        block's keys, read in tiles of :attr:`tile` tokens; ``base``: one-byte scales' int16 base, the scales
        then their uint8 codes, which decode through ``steps``,
        :func:`~kvpolicy.formats.scale_codes.octave_steps`), and the block's centre (or ``None``), after
        checking the block.

        Raises
        ------
        ConfigError
            Naming the role and what is wrong: a container the kernel does not read, a layout or width it
            does not serve, tensors not on the CPU or of the wrong shape or dtype.
        """
        if isinstance(q, PackedTensor):
            return self._packed_args(q, role)
        from kvpolicy.formats.codebook import ScaledBlock  # (a cache of min-max blocks never loads it)

        if isinstance(q, ScaledBlock):
            return self._scaled_args(q, role)
        raise ConfigError(
            f"backend 'cpu' reads min-max blocks (PackedTensor) and blocks of scaled table codes (ScaledBlock); "
            f"got {role}s={type(q).__name__}"
        )

    def prepared(self, q: QTensor, role: str) -> tuple[tuple, torch.Tensor | None]:
        """:meth:`_kernel_args` of ``q`` for ``role``, checked once per block: the result is kept on the block
        (:class:`~kvpolicy.derived.Derived`, under ``PREPARED + "_" + role``) with the backend, codes and scales it
        was checked with, and read back while the block holds those same tensors and this backend reads it. A
        store's block is read at every decode step until the next demotion replaces it, so a step checks
        nothing; a block a caller assembles itself is checked at its first read (and again if its codes or
        scales are replaced). While ``torch.compile`` traces, the block is checked and nothing is kept (a traced
        step has no side effects on the blocks)."""
        if torch.compiler.is_compiling():
            return self._kernel_args(q, role)
        kept = getattr(q, "__dict__", None)
        found = None if kept is None else kept.get(f"{PREPARED}_{role}")
        if found is not None:
            was = found.sources
            if was[0] is self and was[1] is q.codes and was[2] is q.scales:  # type: ignore[attr-defined]
                return found.value
        args = self._kernel_args(q, role)
        if kept is not None:
            kept[f"{PREPARED}_{role}"] = Derived((self, q.codes, q.scales), args)  # type: ignore[attr-defined]
        return args

    def attend(  # type: ignore[override]
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Backend.attend` in the C++ kernel, which adds ``bias`` (if given) to each tile's scores.

        Each block is checked at its first read (:meth:`prepared`), the query's device and dtype whenever they
        differ from the last query's; the shapes of the query, keys and values are compared at every call.

        Parameters
        ----------
        query : torch.Tensor
            ``(B, H, q, D)``, float32 / float16 / bfloat16 (converted to float32 and scaled).
        keys : PackedTensor or ScaledBlock
            ``(B, H, n, D)``: min-max per channel, or scaled table codes; 2, 3 or 4 bits.
        values : PackedTensor or ScaledBlock
            ``(B, H, n, Dv)``: min-max per token, or scaled table codes; 2, 3 or 4 bits.
        scale : float
            Score scale.
        bias : torch.Tensor, optional
            ``(B, H, q, n)``, added to the scaled scores (converted to contiguous float32).

        Returns
        -------
        out : torch.Tensor
            ``(B, H, q, Dv)`` float32 (zeros when ``n = 0``).
        lse : torch.Tensor
            ``(B, H, q)`` float32 (``-inf`` when ``n = 0``).

        Raises
        ------
        ConfigError
            If a block is not one the kernel reads (see :meth:`_kernel_args`), the query's device or dtype is
            not served, or the shapes do not match the query or each other.
        """
        (kc, ks, kz, kt, kbits, kgroup, kbase, ksteps), key_centre = self.prepared(keys, "key")
        (vc, vs, vz, vt, vbits, vgroup, vbase, vsteps), value_centre = self.prepared(values, "value")
        if (query.device.type, query.dtype) != self._query_ok:
            self.check_tensor(query)
            self._query_ok = (query.device.type, query.dtype)
        if query.dim() != 4:
            raise ConfigError(f"backend 'cpu': query must be (batch, kv_heads, q, head_dim); got {tuple(query.shape)}")
        b, h, nq, d = query.shape
        if tuple(keys.shape[:2]) != (b, h) or keys.shape[3] != d:
            raise ConfigError(
                f"backend 'cpu': keys of shape {keys.shape} do not match query of shape {tuple(query.shape)}"
            )
        if tuple(values.shape[:3]) != tuple(keys.shape[:3]):
            raise ConfigError(
                f"backend 'cpu': values of shape {values.shape} do not hold the tokens of keys {keys.shape}"
            )
        n, dv = keys.shape[2], values.shape[3]
        if n == 0 or nq == 0 or b * h == 0:
            return (
                torch.zeros((b, h, nq, dv), dtype=torch.float32),
                torch.full((b, h, nq), -float("inf"), dtype=torch.float32),
            )
        if bias is not None:
            if tuple(bias.shape) != (b, h, nq, n):
                raise ConfigError(f"backend 'cpu': bias of shape {tuple(bias.shape)} for scores {(b, h, nq, n)}")
            bias = bias.float().contiguous()
        if kgroup is None:
            kgroup = max(1, int(self.tile))
        q32 = (query.float() * scale).contiguous()
        compiling = torch.compiler.is_compiling()
        splits = self.splits
        if splits is None:
            programs, tiles = b * h, -(-n // kgroup)
            if compiling:  # the thread count is a constant of the traced graph
                splits = cpu_attention.default_splits(programs, tiles)
            else:  # chosen once per amount of work and thread count
                work = (programs, tiles, torch.get_num_threads())
                splits = self._splits_for.get(work)
                if splits is None:
                    if len(self._splits_for) >= SPLITS_KEPT:
                        self._splits_for.clear()
                    splits = self._splits_for[work] = cpu_attention.default_splits(*work)
        # one-byte scale codes are decoded in the kernel, through the table of their own decoder
        steps = ksteps if ksteps is not None else vsteps
        args = (q32, kc, ks, kz, kt, kbits, kgroup, vc, vs, vz, vt, vbits, vgroup, max(1, int(splits)), kbase, vbase,
                steps, bias)  # fmt: skip
        # while torch.compile traces, the kernel is one custom operator of known output shapes; an eager call
        # goes straight to the loaded module (a custom operator's dispatch costs microseconds per call)
        out, lse = torch.ops.kvpolicy.cpu_attend(*args, dv) if compiling else self._kernel.attend(*args)
        # a centred block: the kernel reads the codes alone, and the centre enters after it
        # (every key score of the block shifts by q · μ, which moves the block's log-sum-exp only; the
        # values' centre adds to the output, whose probabilities sum to one)
        if key_centre is not None:
            lse = lse + torch.matmul(q32, key_centre.float().transpose(-1, -2)).squeeze(-1)
        if value_centre is not None:
            out = out + value_centre.float()
        return out, lse

    def attend_biased(  # type: ignore[override]
        self, query: torch.Tensor, keys: QTensor, values: QTensor, scale: float, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Backend.attend_biased`: :meth:`attend` with ``bias``, which the kernel adds to each tile's scores."""
        return self.attend(query, keys, values, scale, bias)
