"""The ``"query-hadamard"`` transform: keys weighted per channel by what the queries read, then rotated.

A key's quantization error matters only through the scores it enters: an error ``e`` in a key costs
``(q · e)²`` for each query ``q``, so on average ``Σ_c E[q_c²] e_c²``. A rotation spreads error evenly
over the channels, wherever the queries look. This transform multiplies channel ``c`` of each demoted
key by a weight ``w_c`` before the Hadamard rotation (:class:`~kvpolicy.transforms.Hadamard`), so the
quantizer's error, even in the rotated basis, is ``1 / w_c`` larger in channels the queries barely
read and smaller in the ones they do. Values are only rotated.

The weights are fitted once per batch row, layer and KV head, when the layer first demotes tokens,
from what kvpolicy's attention wrapper (:func:`kvpolicy.attention.enable_scores`, or the fused function,
:func:`kvpolicy.fused.enable_fused`) reported of the forwards before: ``m_c``, the mean of ``q_c²`` over
every query row of the KV head's query heads, and ``κ_c``, the variance of channel ``c`` over the keys
the latest of those forwards read (the prompt, at full precision). Then
``w_c = (m_c / κ_c) ** power``, divided by the weights' geometric mean and kept within a factor
``max_ratio`` of each other. With ``power = 1/4`` the expected score error of a quantizer whose error is
isotropic and proportional to the vector's size (the rotated codebook),
``Σ_c (m_c / w_c²) · Σ_c w_c² κ_c``, is smallest (Cauchy-Schwarz): it falls from ``(Σ m)(Σ κ)`` to
``(Σ √(m κ))²``.

Scores stay exact in the new basis: ``q · k̂ = (q / w) · (k̂ ⊙ w)``. The fused decode path divides the
query by ``w`` before rotating it (one ``(batch, kv_heads, 1, head_dim)`` product per step) and reads the
codes as it does for ``"hadamard"``; the materialised keys are un-rotated, then divided by ``w``. The
weights (float32, ``head_dim`` per row and head) are held in the store and counted with the scales; the
query and key moments are held until the weights are fitted, and counted too.

Each row of a left-padded batch fits on its own real tokens' queries and keys, as if run alone. A layer
whose first demotion comes before any forward reported its queries (the model's attention is not
kvpolicy's wrapper) raises, naming the remedy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy import state_check
from kvpolicy.errors import ConfigError, NonFiniteError
from kvpolicy.transforms.base import Basis, BindContext, cast_clamped
from kvpolicy.transforms.hadamard import Hadamard

#: the entries a query-weighted store adds to a transformed store's saved state
STATE_KEYS = ("weights", "query_sq", "query_count", "key_var")
#: the largest ``max_ratio``: weights stay within ``2 ** ±16`` of their geometric mean, so that weighted keys and
#: weighted queries of any model dtype stay finite (float16 keys are held in float32 once transformed)
MAX_RATIO = 2.0**32
#: how far beyond ``log(max_ratio) / 2`` a saved weight's logarithm may be (float32 rounding of a fit's weights)
LOG_TOLERANCE = 1e-4


@dataclass(frozen=True)
class QueryWeighted(Hadamard):
    """Per-channel key weights fitted on the queries, then a randomized Hadamard rotation.

    Parameters
    ----------
    seed : int
        The rotation's seed (:class:`~kvpolicy.transforms.Hadamard`).
    power : float
        ``w_c = (m_c / κ_c) ** power`` (see the module docstring); in ``[0, 1]``. ``0`` gives unit
        weights: the ``"hadamard"`` transform's codes, bit for bit. Default ``0.25``, the power that
        minimises the expected score error of an isotropic quantizer.
    max_ratio : float
        The largest weight is at most ``max_ratio`` times the smallest (each within ``√max_ratio`` of
        their geometric mean); in ``[1, 2**32]``. Bounds what a channel that no query reads, or a constant
        channel, can do to the others. Default 64.
    """

    power: float = 0.25
    max_ratio: float = 64.0

    name = "query-hadamard"
    fits = True
    needs_queries = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for param, value, low, high in (("power", self.power, 0.0, 1.0), ("max_ratio", self.max_ratio, 1.0, MAX_RATIO)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ConfigError(
                    f"{type(self).__name__}: {param} must be a number in [{low:g}, {high:g}]; got {param}={value!r}"
                )

    def bind(self, context: BindContext) -> QueryWeightedBasis:
        """The layer's basis: the query moments until its first demotion, then the key weights."""
        return QueryWeightedBasis(self)

    def fit(self, query_sq: torch.Tensor, count: int, key_var: torch.Tensor) -> torch.Tensor:
        """The key weights from the moments the attention wrapper reported.

        Parameters
        ----------
        query_sq : torch.Tensor
            ``(batch, kv_heads, head_dim)`` float32: ``Σ q_c²`` over ``count`` query rows per KV head.
        count : int
            Query rows summed (``>= 1``).
        key_var : torch.Tensor
            ``(batch, kv_heads, head_dim)`` float32: each channel's variance over the keys read.

        Returns
        -------
        torch.Tensor
            ``(batch, kv_heads, 1, head_dim)`` float32, positive: the weights divided by their geometric mean
            per row and head, each then clamped within ``√max_ratio`` of 1 (so largest over smallest at most
            :attr:`max_ratio`). Finite for any finite moments, zeros included (computed in logarithms).

        Raises
        ------
        NonFiniteError
            If a moment is NaN or infinite.
        ValueError
            If a moment is negative.
        """
        if not (bool(torch.isfinite(query_sq).all()) and bool(torch.isfinite(key_var).all())):
            raise NonFiniteError(
                f"{self!r}: the queries or keys reported to fit the key weights are not finite (NaN or Inf "
                "reached attention); the model's activations are broken"
            )
        if bool((query_sq < 0).any()) or bool((key_var < 0).any()):
            raise ValueError(f"{self!r}: negative query or key moments (sums of squares and variances are >= 0)")
        # in logarithms and float64: moments of any finite size (zeros, 1e38 against 1e-38) give finite weights
        tiny = torch.finfo(torch.float64).tiny
        log_ratio = (query_sq.double() / count).clamp_min(tiny).log() - key_var.double().clamp_min(tiny).log()
        log_w = self.power * log_ratio
        log_w = log_w - log_w.mean(dim=-1, keepdim=True)
        half = math.log(self.max_ratio) / 2
        return log_w.clamp(-half, half).exp().float().unsqueeze(2).contiguous()

    def check_weights(self, weights: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``weights`` ``(batch, kv_heads, 1, head_dim)`` are weights :meth:`fit` can
        give: finite and positive, each within ``√max_ratio`` of 1 (within float32 rounding). A saved store's
        weights are checked so before they weight a key: crafted ones (zeros, huge ranges) would turn keys or
        queries into Inf, and attention into NaN."""
        if not bool((torch.isfinite(weights) & (weights > 0)).all()):
            raise ValueError(f"{self.name} store: weights must be finite and positive")
        top = float(weights.double().log().abs().max()) if weights.numel() else 0.0
        half = math.log(self.max_ratio) / 2
        if top > half + LOG_TOLERANCE:
            raise ValueError(
                f"{self.name} store: a weight {math.exp(min(top, 700.0)):.6g} times (or 1 over that) the unit "
                f"weight, beyond sqrt(max_ratio)={math.exp(half):.6g}: not weights {self!r} fits"
            )


class QueryWeightedBasis(Basis):
    """One layer's query-weighted basis: the moments the attention wrapper reports until the first demotion,
    then the key weights fitted on them (see the module docstring).

    Attributes
    ----------
    weights : torch.Tensor or None
        ``(batch, kv_heads, 1, head_dim)`` float32 once fitted (at the first demotion).
    query_sq : torch.Tensor or None
        ``(batch, kv_heads, head_dim)`` float32 ``Σ q²`` of the queries reported before the fit.
    query_count : int
        Query rows in :attr:`query_sq`.
    key_var : torch.Tensor or None
        ``(batch, kv_heads, head_dim)`` float32, the variance of each key channel over the latest reported
        history.
    """

    transform: QueryWeighted

    def __init__(self, transform: QueryWeighted) -> None:
        super().__init__(transform)
        self.weights: torch.Tensor | None = None
        self.query_sq: torch.Tensor | None = None
        self.query_count = 0
        self.key_var: torch.Tensor | None = None

    @property
    def wants_queries(self) -> bool:  # type: ignore[override]
        """Whether the weights still wait for queries (until the first demotion)."""
        return self.weights is None

    @property
    def fitted(self) -> bool:  # type: ignore[override]
        return self.weights is not None

    def observe(self, query: torch.Tensor, keys: torch.Tensor) -> None:
        """Accumulate the moments of one forward: ``query`` ``(batch, q_heads, q, head_dim)`` in the model's
        basis, ``keys`` ``(batch, kv_heads, n, head_dim)``, the history it read. Ignored once fitted."""
        if self.weights is not None:
            return
        b, hq, nq, d = query.shape
        hk = keys.shape[1]
        if hq % hk or keys.shape[0] != b or keys.shape[-1] != d:
            raise ValueError(f"queries {tuple(query.shape)} do not attend over keys {tuple(keys.shape)}")
        rows = (hq // hk) * nq
        # reductions over the token axis, so that no copy of a long prompt's queries is made
        norms = torch.linalg.vector_norm(query.detach(), dim=2, dtype=torch.float32)  # (batch, q_heads, head_dim)
        sq = norms.pow(2).reshape(b, hk, hq // hk, d).sum(dim=2)
        self.query_sq = sq if self.query_sq is None else self.query_sq + sq
        self.query_count += rows
        if keys.shape[2]:
            k = keys.detach()
            self.key_var = torch.var(k if k.dtype == torch.float32 else k.float(), dim=2, unbiased=False)

    def fit(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The key weights from the moments reported so far (which are then dropped)."""
        if self.query_count == 0 or self.key_var is None:
            raise RuntimeError(
                f"transform {self.transform.name!r} fits its key weights on the queries of the forwards before "
                "a layer's first demotion, and none were reported: the model's attention is not kvpolicy's. "
                "Call kvpolicy.attention.enable_scores(model) (or kvpolicy.fused.enable_fused(model)) once "
                "before running the model."
            )
        assert self.query_sq is not None
        weights = self.transform.fit(self.query_sq, self.query_count, self.key_var)
        if weights.shape[:2] != keys.shape[:2] or weights.shape[-1] != keys.shape[-1]:
            raise ValueError(f"queries reported for {tuple(weights.shape)} weights, keys are {tuple(keys.shape)}")
        self.weights = weights.to(keys.device)
        self.query_sq = self.key_var = None
        self.query_count = 0

    def map_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transform.forward(keys.float() * self.weights).to(keys.dtype)

    def unmap_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.weights is None:
            return self._back(keys)
        dtype = keys.dtype if self.dtype is None else self.dtype
        return cast_clamped(self.transform.inverse(keys.float()) / self.weights, dtype)

    def map_query(self, query: torch.Tensor) -> torch.Tensor:
        """``(q / w) R``."""
        if self.weights is None:
            return super().map_query(query)
        return self.transform.forward(query.float() / self.weights)

    def _held(self) -> list[torch.Tensor]:
        return [t for t in (self.weights, self.query_sq, self.key_var) if t is not None]

    def nbytes(self) -> dict[str, int]:
        """The weights (or the moments awaiting the fit) under ``scales``."""
        return {"scales": sum(t.numel() * t.element_size() for t in self._held())}

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.weights = None if self.weights is None else fn(self.weights)
        self.query_sq = None if self.query_sq is None else fn(self.query_sq)
        self.key_var = None if self.key_var is None else fn(self.key_var)

    def state_dict(self) -> dict[str, Any]:
        """The base state, with the weights and the moments awaiting the fit."""
        out = super().state_dict()
        out.update(weights=self.weights, query_sq=self.query_sq, query_count=self.query_count, key_var=self.key_var)
        return out

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore :meth:`state_dict`; shapes against the layer are checked in :meth:`validate`."""
        if not isinstance(state, dict):
            raise ValueError(f"a query-weighted store's state must be a dict; got {type(state).__name__}")
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"a query-weighted store's state lacks {missing}")
        super().load_state_dict({k: v for k, v in state.items() if k not in STATE_KEYS}, device)
        loaded = {}
        for name in ("weights", "query_sq", "key_var"):
            t = state[name]
            if t is not None:
                what = f"query-weighted store {name}"
                t = state_check.tensor(t, what, torch.float32, (None,) * (4 if name == "weights" else 3))
                if name == "weights":
                    self.transform.check_weights(t)
                state_check.finite(t, what)
                if bool((t < 0).any()):
                    raise ValueError(f"{what} must be >= 0 (a sum of squares or a variance)")
            loaded[name] = t
        count = state_check.integer(state["query_count"], "query_count", 0)
        fitted = loaded["weights"] is not None
        waiting = loaded["query_sq"] is not None
        if fitted and (waiting or loaded["key_var"] is not None or count):
            raise ValueError("query-weighted store: moments are held beside fitted weights")
        if waiting != (count > 0) or (loaded["key_var"] is not None and not waiting):
            raise ValueError(f"query-weighted store: query_count={count} disagrees with the moments held")
        if fitted and loaded["weights"].shape[2] != 1:
            raise ValueError(f"query-weighted store: weights of shape {tuple(loaded['weights'].shape)}")
        self.weights, self.query_sq, self.key_var = loaded["weights"], loaded["query_sq"], loaded["key_var"]
        self.query_count = count

    def validate(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """The base checks, and weights held exactly when tokens are, shaped for the layer's keys."""
        super().validate(keys, values, positions)
        b, h, _, d = keys.shape
        count = positions.shape[-1]
        if (self.weights is not None) != (count > 0):
            raise ValueError(
                f"query-weighted store: {'weights' if self.weights is not None else 'no weights'} for {count} "
                "tokens held"
            )
        if self.weights is not None and tuple(self.weights.shape) != (b, h, 1, d):
            raise ValueError(f"query-weighted store: weights {tuple(self.weights.shape)} for keys {(b, h, '...', d)}")
        for name, t in (("query_sq", self.query_sq), ("key_var", self.key_var)):
            if t is not None and tuple(t.shape) != (b, h, d):
                raise ValueError(f"query-weighted store: {name} {tuple(t.shape)} for keys {(b, h, '...', d)}")
