"""The ``"calibrated-hadamard"`` transform: a rotation per layer and KV head fitted on attention statistics,
then the randomized Hadamard rotation.

A key's quantization error ``e`` costs ``(q · e)²`` per query, ``eᵀ M e`` on average with ``M = E[q qᵀ]``
the queries' second moment. :class:`~kvpolicy_research.query_weighted.QueryWeighted` weights the key
channels by the diagonal of ``M``; this transform takes the whole matrix. Per batch row, layer and KV head:

- keys: ``U`` the eigenbasis of ``M`` (eigenvalues ``λ_i``), ``κ_i = u_iᵀ C u_i`` the keys' variance along
  each eigenvector (``C`` their covariance), and ``w_i = (λ_i / κ_i) ** power`` divided by the weights'
  geometric mean and kept within a factor ``max_ratio`` of each other. A key is stored as ``H(k U ⊙ w)``
  (``H`` the Hadamard rotation, :class:`~kvpolicy.transforms.Hadamard`), so the codes' error, spread evenly
  by ``H``, falls ``1 / w_i`` larger along the directions the queries barely read;
- values: ``V`` the eigenbasis of the values' second moment weighted by the attention each value receives;
  a value is stored as ``H(v V)``. In the eigenbasis the values' coordinates are uncorrelated, so after
  ``H`` every coordinate has the same variance under that weighting (the codebook's assumption).

Scores stay exact: ``q · k = ((q U) / w) · ((k U) ⊙ w)``. The fused decode path maps the query through ``U``,
``1 / w`` and ``H`` (two ``(batch, kv_heads, 1, head_dim)`` products per step) and the output back through
``Hᵀ`` and ``Vᵀ``; the materialised tokens come back through the same maps, so both paths read one basis.

Statistics come from the prompt: the attention wrapper (:func:`kvpolicy.attention.enable_scores`, or
:func:`kvpolicy.fused.enable_fused`) reports the queries of the forwards before a layer's first demotion
and the keys they read (``M``, the queries' mean and ``C``); the values are those of the first demotion,
each weighted by the attention a query drawn from the reported moments gives it in expectation,
``E[exp(s q·k)] = exp(s μ·k + s²/2 · kᵀ Σ k)`` for Gaussian queries of mean ``μ`` and covariance ``Σ``
(``s`` the attention scale). :mod:`kvpolicy_research.calibration` measures the same statistics over
calibration texts into a file, and ``statistics="path/to/file.safetensors"`` reads each layer's rotations
from such a file instead: the layer finds its own in the file when it binds (its
:class:`~kvpolicy.transforms.BindContext` says which layer it is and which model), after the file is checked
against the model and the layer's shapes, and every batch row shares them (they depend on no row), so a
batch row equals the row run alone, left-padded or not.

What the layer holds is counted under ``scales``: ``U`` and ``V`` in float16 (``2 · head_dim²`` half floats per
row and KV head) and the weights in float32, and until the fit, the moments (float32). The maps read the
float16 matrices in float32, and every path (fused, materialised, saved and loaded) reads those same
matrices, so a loaded cache continues bit for bit. Rotations read from a file are held once per layer (one
row, shared by the batch's rows) and counted once under ``transform``, as the Hadamard matrix is; a saved
cache holds them too and continues with the saved ones (the file is read again on load, because the cache
binds the composition it names: a file that is missing then is named in the error). At ``head_dim = 64`` the
matrices cost ``0.5`` bit per element of a 2048-token prompt, ``0.125`` at 8192 (fitted per row; read from
a file, that over the whole batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy import state_check
from kvpolicy.errors import ConfigError, NonFiniteError
from kvpolicy.transforms.base import HELD_DTYPE, Basis, BindContext, cast_clamped
from kvpolicy_research.query_weighted import QueryWeighted

#: the entries a calibrated store adds to a transformed store's saved state
STATE_KEYS = ("key_basis", "key_weights", "value_basis", "query_moment", "query_sum", "query_count", "key_moment")
#: how far a saved basis may be from orthogonal (float16 rounding of an orthogonal matrix: about 1e-3)
ORTHOGONAL_TOLERANCE = 2e-2
#: the dtype the fitted bases are held in
BASIS_DTYPE = torch.float16


@dataclass(frozen=True)
class CalibratedRotation(QueryWeighted):
    """A rotation per layer and KV head fitted on the queries' and values' statistics, then the Hadamard.

    Parameters
    ----------
    seed : int
        The Hadamard rotation's seed (:class:`~kvpolicy.transforms.Hadamard`).
    power : float
        Key weights ``w_i = (λ_i / κ_i) ** power`` along the queries' eigenvectors; in ``[0, 1]``. ``0`` gives
        unit weights (keys only rotated into the queries' eigenbasis). Default ``0.25``, the power that
        minimises the expected score error of an isotropic quantizer (see
        :mod:`kvpolicy_research.query_weighted`, whose weights these are, along other directions).
    max_ratio : float
        The largest key weight is at most ``max_ratio`` times the smallest; in ``[1, 2**32]``. Default 64.
    rotate_values : bool
        Whether values are rotated into their attention-weighted eigenbasis before the Hadamard (default);
        ``False``: values get the Hadamard alone, and the layer holds half the matrices.
    statistics : str or None
        A statistics file (:func:`kvpolicy_research.calibration.save`) to read every layer's rotations from,
        instead of fitting them on the prompt (``None``, the default). Checked when a layer binds, against
        the model the cache was built for (``CompressedCache.for_model``, or ``config=``) and the layer's
        shapes: another model's file, or one of other shapes, is refused naming the file.
    """

    rotate_values: bool = True
    statistics: str | None = None

    name = "calibrated-hadamard"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.rotate_values, bool):
            raise ConfigError(
                f"CalibratedRotation: rotate_values must be True or False; got rotate_values={self.rotate_values!r}"
            )
        if self.statistics is not None and (not isinstance(self.statistics, str) or not self.statistics.strip()):
            raise ConfigError(
                "CalibratedRotation: statistics must be the path of a statistics file (a str) or None; got "
                f"statistics={self.statistics!r:.80}"
            )

    @property
    def needs_queries(self) -> bool:  # type: ignore[override]
        """Whether layers fit on the prompt's queries: unless the rotations come from a file."""
        return self.statistics is None

    def bind(self, context: BindContext) -> CalibratedBasis:
        """The layer's basis: the prompt's moments until its first demotion, then the fitted rotations; or,
        with :attr:`statistics`, the file's rotations for ``context``'s layer (``ValueError`` naming the file,
        or ``ConfigError``, before anything is held, when the file does not serve this model and layer)."""
        if self.statistics is None:
            return CalibratedBasis(self)
        from kvpolicy_research.calibration import layer_rotations

        return CalibratedBasis(self, layer_rotations(self, context))

    # ------------------------------------------------------------------ fitting (pure functions of statistics)
    def key_rotation(self, query_moment: torch.Tensor, key_cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys' basis and weights from the queries' second moment and the keys' covariance.

        Parameters
        ----------
        query_moment : torch.Tensor
            ``(..., head_dim, head_dim)``: ``E[q qᵀ]`` per KV head (symmetric, positive semi-definite).
        key_cov : torch.Tensor
            ``(..., head_dim, head_dim)``: the keys' covariance.

        Returns
        -------
        (torch.Tensor, torch.Tensor)
            ``U`` ``(..., head_dim, head_dim)`` in :data:`BASIS_DTYPE`, eigenvectors of ``query_moment`` as
            columns (largest eigenvalue first, each column's largest entry positive), and the weights
            ``(..., 1, head_dim)`` float32, positive, with geometric mean 1 before the clamp to
            ``√max_ratio`` either side of it.
        """
        _check_moments(self, query_moment, key_cov)
        lam, u = _eigh(query_moment)
        kappa = torch.einsum("...ci,...cd,...di->...i", u, key_cov.double(), u)
        # the diagonal weights of query-weighted keys, along the eigenvectors (rounding can leave an eigenvalue
        # of a semi-definite moment a hair below zero)
        weights = self.fit(lam.clamp_min(0), 1, kappa.clamp_min(0))
        return u.to(BASIS_DTYPE), weights

    def value_rotation(self, value_moment: torch.Tensor) -> torch.Tensor:
        """``V`` ``(..., head_dim, head_dim)`` in :data:`BASIS_DTYPE`: eigenvectors of the values'
        attention-weighted second moment ``(..., head_dim, head_dim)``, ordered and signed as
        :meth:`key_rotation`'s."""
        _check_moments(self, value_moment)
        return _eigh(value_moment)[1].to(BASIS_DTYPE)

    def check_fit(self, basis: torch.Tensor, weights: torch.Tensor | None = None, what: str = "key_basis") -> None:
        """Raise ``ValueError`` unless ``basis`` ``(..., d, d)`` is a float16 matrix within
        :data:`ORTHOGONAL_TOLERANCE` of orthogonal and ``weights`` ``(..., 1, d)`` are weights :meth:`key_rotation`
        can give (finite, positive, within ``√max_ratio`` of 1): what a saved store holds is checked so before
        it maps a key. ``what`` names the basis in the message."""
        if not bool(torch.isfinite(basis).all()):
            raise ValueError(f"calibrated store: {what} holds non-finite entries")
        b = basis.float()
        gram = b.transpose(-1, -2) @ b
        err = float((gram - torch.eye(b.shape[-1])).abs().max()) if b.numel() else 0.0
        if err > ORTHOGONAL_TOLERANCE:
            raise ValueError(f"calibrated store: {what} is {err:.3g} from orthogonal (at most {ORTHOGONAL_TOLERANCE})")
        if weights is not None:
            self.check_weights(weights)


def _check_moments(transform: CalibratedRotation, *moments: torch.Tensor) -> None:
    for m in moments:
        if not bool(torch.isfinite(m).all()):
            raise NonFiniteError(
                f"{transform!r}: the statistics reported to fit the rotation are not finite (NaN or Inf reached "
                "attention); the model's activations are broken"
            )
        if m.shape[-1] != m.shape[-2]:
            raise ValueError(f"{transform!r}: a moment of shape {tuple(m.shape)} is not square")


def _eigh(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending) and eigenvectors (columns, largest entry of each positive) of a symmetric
    ``(..., d, d)`` matrix, in float64: a deterministic choice among the bases ``eigh`` may give."""
    sym = moment.double()
    sym = (sym + sym.transpose(-1, -2)) / 2
    lam, u = torch.linalg.eigh(sym)
    lam, u = lam.flip(-1), u.flip(-1)
    pivot = u.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(u.gather(-2, pivot))
    return lam, u * torch.where(sign == 0, torch.ones_like(sign), sign)


def expected_attention(
    keys: torch.Tensor, query_mean: torch.Tensor, query_cov: torch.Tensor, scale: float
) -> torch.Tensor:
    """Each key's share of ``E[exp(s q·k)]`` for Gaussian queries: ``(..., n)`` float64, summing to 1.

    Parameters
    ----------
    keys : torch.Tensor
        ``(..., n, head_dim)``.
    query_mean, query_cov : torch.Tensor
        ``(..., head_dim)`` and ``(..., head_dim, head_dim)``: the queries' mean and covariance.
    scale : float
        The attention scale ``s``.
    """
    k = keys.double()
    log_w = scale * (k @ query_mean.double().unsqueeze(-1)).squeeze(-1)
    log_w = log_w + scale**2 / 2 * torch.einsum("...nc,...cd,...nd->...n", k, query_cov.double(), k)
    return torch.softmax(log_w, dim=-1)


def _per_row(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x @ m`` for ``x`` ``(batch, kv_heads, n, d)`` and ``m`` ``(batch, kv_heads, d, d')``, float32, one batch
    row at a time, on contiguous operands: a product may round a row differently with other rows beside it or
    another memory layout, and a batch row must equal the row run alone."""
    x, m = x.float().contiguous(), m.float().contiguous()
    if x.shape[0] == 1:
        return x @ m
    if m.shape[0] == 1:  # one matrix for every row (rotations read from a file)
        return torch.cat([x[i : i + 1] @ m for i in range(x.shape[0])])
    return torch.cat([x[i : i + 1] @ m[i : i + 1] for i in range(x.shape[0])])


class CalibratedBasis(Basis):
    """One layer's calibrated basis (see the module docstring).

    Attributes
    ----------
    key_basis, value_basis : torch.Tensor or None
        ``(batch, kv_heads, head_dim, head_dim)`` float16 once fitted (``value_basis`` ``None`` when the
        transform leaves values to the Hadamard alone).
    key_weights : torch.Tensor or None
        ``(batch, kv_heads, 1, head_dim)`` float32 once fitted.
    query_moment : torch.Tensor or None
        ``(batch, kv_heads, head_dim, head_dim)`` float32: ``Σ q qᵀ`` of the queries reported before the fit.
    query_sum : torch.Tensor or None
        ``(batch, kv_heads, head_dim)`` float32: ``Σ q``.
    query_count : int
        Query rows summed.
    key_moment : torch.Tensor or None
        ``(batch, kv_heads, head_dim, head_dim)`` float32: the covariance of the keys the latest reported
        forward read.
    from_file : bool
        Whether the rotations were read from a statistics file: then one row ``(1, kv_heads, ...)`` from the
        start, shared by every batch row and by the layers of other caches bound with the same file.
    """

    transform: CalibratedRotation

    def __init__(
        self,
        transform: CalibratedRotation,
        rotations: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    ) -> None:
        super().__init__(transform)
        self.from_file = rotations is not None
        self.key_basis, self.key_weights, self.value_basis = rotations if rotations is not None else (None,) * 3
        self._file = rotations
        self.query_moment: torch.Tensor | None = None
        self.query_sum: torch.Tensor | None = None
        self.query_count = 0
        self.key_moment: torch.Tensor | None = None

    @property
    def wants_queries(self) -> bool:  # type: ignore[override]
        """Whether the rotation still waits for queries (until the first demotion)."""
        return self.key_basis is None

    @property
    def fitted(self) -> bool:  # type: ignore[override]
        return self.key_basis is not None

    # ------------------------------------------------------------------ fitting
    def observe(self, query: torch.Tensor, keys: torch.Tensor) -> None:
        """Accumulate the moments of one forward: ``query`` ``(batch, q_heads, q, head_dim)`` in the model's
        basis, ``keys`` ``(batch, kv_heads, n, head_dim)`` the history it read. Ignored once fitted."""
        if self.key_basis is not None:
            return
        b, hq, nq, d = query.shape
        hk = keys.shape[1]
        if hq % hk or keys.shape[0] != b or keys.shape[-1] != d:
            raise ValueError(f"queries {tuple(query.shape)} do not attend over keys {tuple(keys.shape)}")
        q = query.detach().float().reshape(b, hk, (hq // hk) * nq, d)
        moment, total = q.transpose(-1, -2) @ q, q.sum(dim=2)
        self.query_moment = moment if self.query_moment is None else self.query_moment + moment
        self.query_sum = total if self.query_sum is None else self.query_sum + total
        self.query_count += (hq // hk) * nq
        if keys.shape[2]:
            k = keys.detach().float()
            k = k - k.mean(dim=2, keepdim=True)
            self.key_moment = k.transpose(-1, -2) @ k / keys.shape[2]

    def fit(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The rotations from the moments reported so far (which are then dropped) and the first demotion's
        ``keys``/``values`` ``(batch, kv_heads, n, head_dim)``."""
        if self.query_count == 0 or self.key_moment is None:
            raise RuntimeError(
                f"transform {self.transform.name!r} fits its rotation on the queries of the forwards before a "
                "layer's first demotion, and none were reported: the model's attention is not kvpolicy's. Call "
                "kvpolicy.attention.enable_scores(model) (or kvpolicy.fused.enable_fused(model)) once before "
                "running the model."
            )
        assert self.query_moment is not None and self.query_sum is not None
        moment = self.query_moment.double() / self.query_count
        if moment.shape[:2] != keys.shape[:2] or moment.shape[-1] != keys.shape[-1]:
            raise ValueError(f"queries reported for {tuple(moment.shape)} moments, keys are {tuple(keys.shape)}")
        u, w = self.transform.key_rotation(moment, self.key_moment)
        v = None
        if self.transform.rotate_values:
            mean = self.query_sum.double() / self.query_count
            cov = moment - mean.unsqueeze(-1) * mean.unsqueeze(-2)
            share = expected_attention(keys, mean, cov, keys.shape[-1] ** -0.5)  # (batch, kv_heads, n)
            vals = values.double()
            v = self.transform.value_rotation(vals.transpose(-1, -2) @ (share.unsqueeze(-1) * vals))
            v = v.to(keys.device)
        self.key_basis, self.key_weights, self.value_basis = u.to(keys.device), w.to(keys.device), v
        self.query_moment = self.query_sum = self.key_moment = None
        self.query_count = 0

    # ------------------------------------------------------------------ the maps
    def map_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``H((k U) ⊙ w)``."""
        return self.transform.forward(_per_row(keys, self.key_basis) * self.key_weights).to(keys.dtype)

    def add(self, store: Any, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        if self.value_basis is not None:
            values = _per_row(values, self.value_basis).to(HELD_DTYPE.get(values.dtype, values.dtype))
        super().add(store, keys, values, positions)

    def unmap_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.key_basis is None:
            return self._back(keys)
        dtype = keys.dtype if self.dtype is None else self.dtype
        back = _per_row(self.transform.inverse(keys.float()) / self.key_weights, self.key_basis.mT)
        return cast_clamped(back, dtype)

    def unmap_values(self, values: torch.Tensor) -> torch.Tensor:
        if self.value_basis is None:
            return self._back(values)
        dtype = values.dtype if self.dtype is None else self.dtype
        return cast_clamped(_per_row(self.transform.inverse(values.float()), self.value_basis.mT), dtype)

    def map_query(self, query: torch.Tensor) -> torch.Tensor:
        """``H((q U) / w)``."""
        if self.key_basis is None:
            return super().map_query(query)
        return self.transform.forward(_per_row(query, self.key_basis) / self.key_weights)

    def unmap_output(self, out: torch.Tensor) -> torch.Tensor:
        """``Hᵀ(o) Vᵀ``."""
        back = self.transform.inverse(out)
        if self.value_basis is None:
            return back
        return _per_row(back, self.value_basis.mT).to(back.dtype)

    # ------------------------------------------------------------------ batch moves, bytes and saving
    def _tensors(self) -> dict[str, torch.Tensor | None]:
        return {
            "key_basis": self.key_basis, "key_weights": self.key_weights, "value_basis": self.value_basis,
            "query_moment": self.query_moment, "query_sum": self.query_sum, "key_moment": self.key_moment,
        }  # fmt: skip

    def nbytes(self) -> dict[str, int]:
        """The bases and weights (or the moments awaiting the fit) under ``scales``; a file's rotations are
        :meth:`shared` instead."""
        if self.from_file:
            return {}
        return {"scales": sum(t.numel() * t.element_size() for t in self._tensors().values() if t is not None)}

    def shared(self) -> list[tuple[str, torch.Tensor]]:
        """The Hadamard matrix, and a file's rotations, under ``transform`` (counted once however many rows and
        caches hold them)."""
        out = super().shared()
        if self.from_file:
            out += [("transform", t) for t in self._tensors().values() if t is not None]
        return out

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.from_file:  # one row for every row: nothing moves with the batch
            return
        for name, t in self._tensors().items():
            if t is not None:
                setattr(self, name, fn(t))

    def state_dict(self) -> dict[str, Any]:
        """The base state, with the fitted rotations and the moments awaiting the fit."""
        out = super().state_dict()
        out.update(self._tensors(), query_count=self.query_count)
        return out

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore :meth:`state_dict` (untrusted: ``ValueError`` names what is wrong); shapes against the
        layer are checked in :meth:`validate`."""
        if not isinstance(state, dict):
            raise ValueError(f"a calibrated store's state must be a dict; got {type(state).__name__}")
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"a calibrated store's state lacks {missing}")
        super().load_state_dict({k: v for k, v in state.items() if k not in STATE_KEYS}, device)
        dims = {"key_basis": 4, "key_weights": 4, "value_basis": 4, "query_moment": 4, "query_sum": 3, "key_moment": 4}
        loaded: dict[str, torch.Tensor | None] = {}
        for name, ndim in dims.items():
            t = state[name]
            if t is not None:
                dtype = BASIS_DTYPE if name.endswith("basis") else torch.float32
                t = state_check.tensor(t, f"calibrated store {name}", dtype, (None,) * ndim)
                state_check.finite(t, f"calibrated store {name}")
            loaded[name] = t
        count = state_check.integer(state["query_count"], "query_count", 0)
        fitted = loaded["key_basis"] is not None
        waiting = [loaded[n] is not None for n in ("query_moment", "query_sum")]
        if fitted:
            if any(waiting) or loaded["key_moment"] is not None or count:
                raise ValueError("calibrated store: moments are held beside a fitted rotation")
            if loaded["key_weights"] is None or (loaded["value_basis"] is None) == self.transform.rotate_values:
                raise ValueError(
                    f"calibrated store: a fitted rotation lacks its key weights, or holds a value basis where "
                    f"{self.transform!r} {'fits' if self.transform.rotate_values else 'fits none'}"
                )
            self.transform.check_fit(loaded["key_basis"], loaded["key_weights"])
            if loaded["value_basis"] is not None:
                self.transform.check_fit(loaded["value_basis"], what="value_basis")
        elif loaded["key_weights"] is not None or loaded["value_basis"] is not None:
            raise ValueError("calibrated store: key weights or a value basis without a key basis")
        elif (
            any(waiting) != (count > 0)
            or not all(w == waiting[0] for w in waiting)
            or (loaded["key_moment"] is not None and not waiting[0])
        ):
            raise ValueError(f"calibrated store: query_count={count} disagrees with the moments held")
        if self.from_file:
            self._load_file_rotations(loaded)
            return
        for name, t in loaded.items():
            setattr(self, name, t)
        self.query_count = count

    def _load_file_rotations(self, loaded: dict[str, torch.Tensor | None]) -> None:
        """Take the saved rotations of a basis bound to a statistics file: one row, as the file gives; the saved
        ones are kept (the tokens were coded with them), as the very tensors the file gives when they are equal
        to them (held once again)."""
        if loaded["key_basis"] is None:
            raise ValueError(f"calibrated store: no rotation saved, where {self.transform!r} reads one from its file")
        for name in ("key_basis", "key_weights", "value_basis"):
            t = loaded[name]
            if t is not None and t.shape[0] != 1:
                raise ValueError(
                    f"calibrated store: {name} of {t.shape[0]} rows, where rotations read from a file are one row"
                )
        assert self._file is not None
        saved = tuple(loaded[n] for n in ("key_basis", "key_weights", "value_basis"))
        same = all(
            (t is None) == (f is None) and (t is None or torch.equal(t.to(f.device), f))
            for t, f in zip(saved, self._file, strict=True)
        )
        if not same:
            self.key_basis, self.key_weights, self.value_basis = saved

    def validate(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """The base checks, and a rotation held exactly when tokens are, shaped for the layer."""
        super().validate(keys, values, positions)
        b, h, _, d = keys.shape
        dv = values.shape[-1]
        count = positions.shape[-1]
        if self.from_file:  # one row for every row, held from the start
            b = 1
        elif (self.key_basis is not None) != (count > 0):
            raise ValueError(
                f"calibrated store: {'a' if self.key_basis is not None else 'no'} rotation for {count} tokens held"
            )
        want = {
            "key_basis": (b, h, d, d), "key_weights": (b, h, 1, d), "value_basis": (b, h, dv, dv),
            "query_moment": (b, h, d, d), "query_sum": (b, h, d), "key_moment": (b, h, d, d),
        }  # fmt: skip
        for name, t in self._tensors().items():
            if t is not None and tuple(t.shape) != want[name]:
                raise ValueError(f"calibrated store: {name} {tuple(t.shape)} for a layer of keys {(b, h, '...', d)}")
