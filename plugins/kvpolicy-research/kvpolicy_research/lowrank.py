"""The ``"lowrank"`` transform: each head's principal key directions held apart, the residual rotated.

The keys of a head share structure: a few directions carry much of their variance. At a layer's first
demotion this transform fits, per batch row and KV head, the mean ``μ`` of the demoted keys and their
``r`` principal directions ``U`` (``(head_dim, r)``, orthonormal: the top eigenvectors of their
covariance), and holds every demoted key as

``k = μ + c Uᵀ + e``, with ``c = (k − μ) U`` (``r`` coefficients) and ``e = (k − μ) − c Uᵀ``.

The coefficients are held beside the codes at higher precision (8-bit integers with a float16 scale per
token and head, or float16), and the residual ``e`` goes through the Hadamard rotation
(:class:`~kvpolicy.transforms.Hadamard`) to whatever the action quantizes. The residual lies in the
complement of ``U``, so the reconstruction projects its decoded form back there, and the quantization error
the codes put along ``U`` is dropped: ``k̂ = μ + ĉ Uᵀ + P (R⁻¹ ê)`` with ``P = I − U Uᵀ``. Values are only
rotated (their low-rank part would need the attention probabilities inside the fused kernels).

The rank is fixed (``rank``). Neither an energy threshold nor shrinkage per head rescues the trade on the
models measured (docs/explanation/quantization.md): at equal bits, no key head gained.

When the first demotion is a long prompt's, the basis is fitted on it in one piece (the layer demotes that
block whole, as it does for a centred codebook's first block). A prompt shorter than the policy's
full-precision set reaches its first demotion during decoding, and the basis is then fitted on the few
tokens demoted first; the reconstruction stays exact apart from the quantizers, but the basis carries
little.

Scores stay exact in the held form: ``q · k̂ = q · μ + (q U) · ĉ + (P q) R · ê``. The fused decode path
rotates ``P q`` into the codes' basis once per step and scores the codes as for ``"hadamard"``; it adds
``(q U) · ĉ + q · μ`` to each token's score: the basis' score term (:meth:`LowRankBasis.score_term`, once
per step for the whole table), which the fused path takes at each part's positions and every backend adds to
its scores (:meth:`kvpolicy.backends.base.Backend.attend_biased`; the ``cpu`` kernel adds it to each tile's).
The coefficients are kept in a table with a column per position, so that tokens the tiers move or reorder
find theirs.

Bytes: the coefficients (``r`` bytes per token and head at 8 bits) are counted with the codes; their scales,
``μ`` and ``U`` (float32, ``head_dim · (r + 1)`` per row and head) with the scales. The table has a row for
every position up to the largest demoted one; rows of positions still at full precision are held (zero)
and counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy import state_check
from kvpolicy.errors import ConfigError, MetadataOverflowError, NonFiniteError
from kvpolicy.layer.parts import columns
from kvpolicy.transforms.base import Basis, BindContext, cast_clamped
from kvpolicy.transforms.hadamard import Hadamard

#: the entries a low-rank store adds to a transformed store's saved state
STATE_KEYS = ("centre", "directions", "coefficients", "coefficient_scales")
#: the coefficient table grows by this many positions at a time (a copy of the table every ``GROW`` decode steps)
GROW = 64
#: coefficient widths served: 8-bit integers with a float16 scale per token and head, or float16
COEFFICIENT_BITS = (8, 16)


@dataclass(frozen=True)
class LowRank(Hadamard):
    """A rank-``r`` part of each demoted key held beside the codes; the residual (and values) rotated.

    Parameters
    ----------
    seed : int
        The rotation's seed (:class:`~kvpolicy.transforms.Hadamard`).
    rank : int
        Principal directions per batch row, layer and KV head; ``1 <= rank <= head_dim`` of the keys
        (checked on the layer's first update). Default 8.
    coefficient_bits : int
        8: each token's coefficients as 8-bit integers with one float16 scale per token and head (their
        largest magnitude over 127); 16: float16 coefficients. Default 8.
    """

    rank: int = 8
    coefficient_bits: int = 8

    name = "lowrank"
    fits = True

    def __post_init__(self) -> None:
        super().__post_init__()
        rank = self.rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ConfigError(
                f"LowRank: rank must be an integer >= 1 (and at most the keys' head_dim); got rank={rank!r}"
            )
        if self.coefficient_bits not in COEFFICIENT_BITS or isinstance(self.coefficient_bits, bool):
            raise ConfigError(
                f"LowRank: coefficient_bits must be one of {list(COEFFICIENT_BITS)}; got "
                f"coefficient_bits={self.coefficient_bits!r}"
            )

    def check_key_head_dim(self, head_dim: int) -> None:
        """Raise :class:`ConfigError` unless ``rank`` directions fit keys of ``head_dim`` channels."""
        if self.rank > head_dim:
            raise ConfigError(
                f"LowRank: rank={self.rank} is larger than the keys' head_dim={head_dim}; rank must be in "
                f"[1, {head_dim}] for this model"
            )

    def bind(self, context: BindContext) -> LowRankBasis:
        """The layer's basis: its mean and directions once fitted, and the coefficient table."""
        return LowRankBasis(self)

    def fit(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and the principal directions of ``keys``.

        Parameters
        ----------
        keys : torch.Tensor
            ``(batch, kv_heads, n, head_dim)``, ``n >= 1``.

        Returns
        -------
        centre : torch.Tensor
            ``(batch, kv_heads, 1, head_dim)`` float32.
        directions : torch.Tensor
            ``(batch, kv_heads, head_dim, rank)`` float32, orthonormal columns, largest variance first.
        """
        self.check_key_head_dim(keys.shape[-1])
        x = keys.detach().double()
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteError(f"{self!r}: the keys of the first demotion are not finite (NaN or Inf); cannot fit")
        centre = x.mean(dim=2, keepdim=True)
        xc = x - centre
        _, vectors = torch.linalg.eigh(xc.transpose(-1, -2) @ xc)  # ascending eigenvalues
        directions = vectors[..., -self.rank :].flip(-1)
        # standard strides (a loaded copy has them): at rank 1 eigh's column-major layout would otherwise leave
        # the size-1 dimension a stride that sends the matmuls to another kernel, a few ulps apart
        return (centre.float().clone(memory_format=torch.contiguous_format),
                directions.float().clone(memory_format=torch.contiguous_format))  # fmt: skip

    def encode(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Coefficients ``(batch, kv_heads, n, rank)`` float32 as held: ``(codes, scales)``.

        8 bits: int8 codes and float16 scales ``(batch, kv_heads, n, 1)``; 16 bits: float16 codes, no scales.

        Raises
        ------
        MetadataOverflowError
            If finite coefficients do not fit float16 (a scale, or a 16-bit coefficient, would be infinite).
        """
        if self.coefficient_bits == 16:
            codes = c.to(torch.float16)
            if not bool(torch.isfinite(codes).all()) and bool(torch.isfinite(c).all()):
                raise MetadataOverflowError(
                    f"{self!r}: a coefficient beyond float16's range; use coefficient_bits=8 (float16 scales of "
                    "8-bit codes reach 127 times further)"
                )
            return codes, None
        scales = (c.abs().amax(dim=-1, keepdim=True) / 127).to(torch.float16)
        if not bool(torch.isfinite(scales).all()) and bool(torch.isfinite(c).all()):
            raise MetadataOverflowError(f"{self!r}: a coefficient scale beyond float16's range (keys above 8e6)")
        s = scales.float()
        codes = torch.where(s > 0, c / s.clamp_min(torch.finfo(torch.float32).tiny), 0.0).round().clamp(-127, 127)
        return codes.to(torch.int8), scales

    @staticmethod
    def decode(codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """:meth:`encode`'s coefficients back, float32 ``(batch, kv_heads, n, rank)``."""
        return codes.float() if scales is None else codes.float() * scales.float()


def _put(table: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor) -> None:
    """``table`` ``(batch, kv_heads, w, P)`` at ``positions`` ``(1 or kv_heads, n)`` := ``columns``
    ``(batch, kv_heads, w, n)``, in place."""
    idx = positions.to(device=table.device, dtype=torch.long)
    if idx.shape[0] == 1:
        table.index_copy_(3, idx[0], columns)
    else:
        b, h, w, n = columns.shape
        table.scatter_(3, idx[None, :, None, :].expand(b, h, w, n), columns)


class LowRankBasis(Basis):
    """One layer's low-rank basis: the mean and principal directions fitted on its first demotion, and each
    demoted key's coefficients, held beside the codes of its rotated residual (see the module docstring).

    Attributes
    ----------
    centre : torch.Tensor or None
        ``(batch, kv_heads, 1, head_dim)`` float32 once fitted.
    directions : torch.Tensor or None
        ``(batch, kv_heads, head_dim, rank)`` float32, ``U``: orthonormal columns.
    coefficients : torch.Tensor or None
        ``(batch, kv_heads, rank, P)``: int8 codes (8 bits) or float16, column ``p`` for position ``p``.
    coefficient_scales : torch.Tensor or None
        ``(batch, kv_heads, 1, P)`` float16 (8 bits), else ``None``.
    """

    transform: LowRank
    #: the fit reads the first demotion's keys: the layer hands it whole
    fits_keys = True

    def __init__(self, transform: LowRank) -> None:
        super().__init__(transform)
        self.centre: torch.Tensor | None = None
        self.directions: torch.Tensor | None = None
        self.coefficients: torch.Tensor | None = None
        self.coefficient_scales: torch.Tensor | None = None

    @property
    def fitted(self) -> bool:  # type: ignore[override]
        return self.directions is not None

    def fit(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.centre, self.directions = self.transform.fit(keys)

    # ------------------------------------------------------------------ storing
    def add(self, store: Any, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Store the rotated residuals of ``keys`` (and the rotated ``values``), then their coefficients."""
        assert self.centre is not None and self.directions is not None
        codes, scales = self.transform.encode((keys.float() - self.centre) @ self.directions)
        super().add(store, keys, values, positions)
        self._write(codes.transpose(-1, -2), None if scales is None else scales.transpose(-1, -2), positions)

    def map_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.centre is not None and self.directions is not None
        x = keys.float() - self.centre
        residual = x - (x @ self.directions) @ self.directions.transpose(-1, -2)
        return self.transform.forward(residual).to(keys.dtype)

    def _write(self, codes: torch.Tensor, scales: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Put the coefficients ``(batch, kv_heads, rank, n)`` of tokens at ``positions`` ``(rows, n)`` in the
        table, growing it by :data:`GROW` positions."""
        if positions.shape[-1] == 0:
            return
        need = int(positions.max()) + 1
        b, h, r, _ = codes.shape
        have = 0 if self.coefficients is None else self.coefficients.shape[3]
        if need > have:
            size = -(-need // GROW) * GROW
            grown = codes.new_zeros((b, h, r, size))
            grown_scales = None if scales is None else scales.new_zeros((b, h, 1, size))
            if self.coefficients is not None:
                grown[..., :have] = self.coefficients
                if grown_scales is not None and self.coefficient_scales is not None:
                    grown_scales[..., :have] = self.coefficient_scales
            self.coefficients, self.coefficient_scales = grown, grown_scales
        assert self.coefficients is not None
        _put(self.coefficients, positions, codes)
        if scales is not None:
            assert self.coefficient_scales is not None
            _put(self.coefficient_scales, positions, scales)

    # ------------------------------------------------------------------ reading
    def coefficients_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The decoded coefficients of the tokens at ``positions`` ``(rows, n)``: ``(batch, kv_heads, n, rank)``
        float32."""
        assert self.coefficients is not None
        scales = None if self.coefficient_scales is None else columns(self.coefficient_scales, positions)
        return self.transform.decode(columns(self.coefficients, positions), scales).transpose(-1, -2)

    def unmap_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``μ + ĉ Uᵀ + P (R⁻¹ ê)`` for the store's rotated residuals ``keys`` at ``positions``."""
        if self.directions is None:
            return self._back(keys)
        assert self.centre is not None
        residual = self.transform.inverse(keys.float())
        residual = residual - (residual @ self.directions) @ self.directions.transpose(-1, -2)
        own = self.coefficients_at(positions) @ self.directions.transpose(-1, -2)
        return cast_clamped(self.centre + own + residual, keys.dtype if self.dtype is None else self.dtype)

    def map_query(self, query: torch.Tensor) -> torch.Tensor:
        """``(P q) R``: the query's part that scores the residuals."""
        if self.directions is None:
            return super().map_query(query)
        q = query.float()
        return self.transform.forward(q - (q @ self.directions) @ self.directions.transpose(-1, -2))

    def score_term(self, query: torch.Tensor, scale: float) -> torch.Tensor | None:
        """``scale · ((q U) · ĉ_p + q · μ)`` for each query and each position ``p`` of the table: ``(batch,
        kv_heads, q, P)`` float32 (positions never demoted score ``q · μ``; no part names them)."""
        if self.directions is None:
            return None
        assert self.centre is not None and self.coefficients is not None
        q = query.float()
        scores = (q @ self.directions) @ self.coefficients.float()
        if self.coefficient_scales is not None:
            scores = scores * self.coefficient_scales.float()
        return (scores + q @ self.centre.transpose(-1, -2)) * scale

    # ------------------------------------------------------------------ bookkeeping
    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.centre, self.directions, self.coefficients, self.coefficient_scales

    def nbytes(self) -> dict[str, int]:
        """The coefficients under ``codes``; their scales, ``μ`` and ``U`` under ``scales``."""
        size = [0 if t is None else t.numel() * t.element_size() for t in self._tensors()]
        return {"codes": size[2], "scales": size[3] + size[0] + size[1]}

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.centre, self.directions, self.coefficients, self.coefficient_scales = (
            None if t is None else fn(t) for t in self._tensors()
        )

    def state_dict(self) -> dict[str, Any]:
        """The base state, with the centre, the basis and the coefficient table."""
        return {**super().state_dict(), **dict(zip(STATE_KEYS, self._tensors(), strict=True))}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore :meth:`state_dict`; shapes against the layer are checked in :meth:`validate`."""
        if not isinstance(state, dict):
            raise ValueError(f"a low-rank store's state must be a dict; got {type(state).__name__}")
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"a low-rank store's state lacks {missing}")
        super().load_state_dict({k: v for k, v in state.items() if k not in STATE_KEYS}, device)
        eight = self.transform.coefficient_bits == 8
        dtypes = {
            "centre": torch.float32, "directions": torch.float32,
            "coefficients": torch.int8 if eight else torch.float16, "coefficient_scales": torch.float16,
        }  # fmt: skip
        loaded: dict[str, torch.Tensor | None] = {}
        for name, dtype in dtypes.items():
            t = state[name]
            if t is not None:
                t = state_check.tensor(t, f"low-rank store {name}", dtype, (None,) * 4)
                if t.is_floating_point():
                    state_check.finite(t, f"low-rank store {name}")
            loaded[name] = t
        present = [loaded[k] is not None for k in ("centre", "directions", "coefficients")]
        if any(present) and not all(present):
            raise ValueError("low-rank store: centre, directions and coefficients are held together or not at all")
        scales_missing = loaded["coefficient_scales"] is None
        if scales_missing == (all(present) and eight):
            raise ValueError(
                f"low-rank store: coefficient scales {'missing' if scales_missing else 'held'} "
                f"for coefficient_bits={self.transform.coefficient_bits}"
            )
        basis, scales = loaded["directions"], loaded["coefficient_scales"]
        if basis is not None:
            if basis.shape[-1] != self.transform.rank:
                raise ValueError(f"low-rank store: a basis of rank {basis.shape[-1]} for {self.transform!r}")
            eye = torch.eye(basis.shape[-1], dtype=torch.float32, device=basis.device)
            if float((basis.transpose(-1, -2) @ basis - eye).abs().amax()) > 1e-3:
                raise ValueError("low-rank store: the basis' columns are not orthonormal")
        if scales is not None and bool((scales < 0).any()):
            raise ValueError("low-rank store: negative coefficient scales")
        self.centre, self.directions = loaded["centre"], loaded["directions"]
        self.coefficients, self.coefficient_scales = loaded["coefficients"], scales

    def validate(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """The base checks, and a fit held exactly when tokens are, shaped for the layer's keys, with a
        coefficient row for every held position."""
        super().validate(keys, values, positions)
        b, h, _, d = keys.shape
        count = positions.shape[-1]
        if (self.directions is not None) != (count > 0):
            raise ValueError(f"low-rank store: {'no basis' if count else 'a basis'} for {count} tokens held")
        if self.directions is None:
            return
        assert self.centre is not None and self.coefficients is not None
        r = self.transform.rank
        for name, shape in (("centre", (b, h, 1, d)), ("directions", (b, h, d, r))):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"low-rank store: {name} {tuple(getattr(self, name).shape)}, expected {shape}")
        c = self.coefficients
        if tuple(c.shape[:3]) != (b, h, r):
            raise ValueError(f"low-rank store: coefficients {tuple(c.shape)} for keys {(b, h, '...', d)} at rank {r}")
        if self.coefficient_scales is not None and tuple(self.coefficient_scales.shape) != (b, h, 1, c.shape[3]):
            raise ValueError(
                f"low-rank store: coefficient scales {tuple(self.coefficient_scales.shape)} for {tuple(c.shape)}"
            )
        top = int(positions.max())
        if top >= c.shape[3]:
            raise ValueError(f"low-rank store: position {top} held, coefficients for {c.shape[3]} positions")
