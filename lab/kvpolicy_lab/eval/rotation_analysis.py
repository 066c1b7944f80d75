"""Does a rotation help this model's quantized keys? (``kvpolicy analyze rotation``)

Rotating keys before per-channel min-max quantization spreads the error of the widest channels over
every channel. Whether that helps depends on where the queries look, not on the keys alone: the
error of a score ``q·k`` is ``q·e``, so an error in a channel that the queries do not read costs
nothing. Per-channel groups already confine the large errors to the wide channels; if the queries
put little energy there, rotation moves those errors to where the queries do read.

Method. ``context + queries`` tokens of a standard-library text (the ``lm`` task's sample ``seed``)
run through the model once, uncompressed; a capturing attention function keeps, in every
full-attention layer, the keys (after their norm and RoPE: what a cache stores) and the queries of the
last ``queries`` positions. The keys of the first ``context`` tokens (whole groups of
``group_size``) are quantized per channel at ``bits``, once as they are and once in the basis of
``transform`` (then rotated back), as the cache's ``Quantize`` action does; the later keys stay
exact. Per layer and basis: the keys' relative squared error, the RMS error of the scaled scores over
the quantized keys, and the KL divergence of each query's attention distribution from the exact
one (mean over queries and heads). The share of the queries' energy (``q_c²``) that falls on the 8
channels whose keys span the widest range says why. Only keys are analysed: the rotation matters to
them through the queries, measured here; a value's error reaches the model through the attention
weights and the output projection, which this analysis does not model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpolicy.errors import ConfigError
from kvpolicy.transforms.base import Transform
from kvpolicy_lab.eval.markdown import md_table

#: channels counted as "the widest" in the query-energy share
WIDE_CHANNELS = 8
#: the capturing attention implementation's name (registered with transformers on use)
_CAPTURE = "kvpolicy_capture_sdpa"


@dataclass(frozen=True)
class LayerRotation:
    """One layer's key error with and without the transform (``plain``, ``rotated``: the two bases).

    Attributes
    ----------
    key_error : tuple of float
        ``‖K̂ - K‖² / ‖K‖²`` over the quantized keys.
    score_rms : tuple of float
        RMS of ``(q·k̂ - q·k) × scaling`` over queries, heads and quantized keys.
    attention_kl : tuple of float
        Mean KL(exact ‖ quantized) of the queries' attention distributions (nats).
    wide_share : float
        Share of the queries' energy on the :data:`WIDE_CHANNELS` widest key channels (plain basis).
    """

    layer: int
    key_error: tuple[float, float]
    score_rms: tuple[float, float]
    attention_kl: tuple[float, float]
    wide_share: float


@dataclass
class RotationAnalysis:
    """Result of :func:`analyze_rotation`."""

    model: str
    transform: str
    bits: int
    group_size: int
    context: int
    queries: int
    layers: list[LayerRotation] = field(default_factory=list)

    def helped(self) -> int:
        """Layers where the transform lowers the attention KL."""
        return sum(r.attention_kl[1] < r.attention_kl[0] for r in self.layers)

    def mean_kl(self) -> tuple[float, float]:
        """Mean attention KL over the layers: (plain, rotated)."""
        n = len(self.layers)
        return sum(r.attention_kl[0] for r in self.layers) / n, sum(r.attention_kl[1] for r in self.layers) / n

    def changes_nothing(self) -> bool:
        """The mean attention KL is the same in both bases (the identity transform)."""
        plain, rotated = self.mean_kl()
        return math.isclose(plain, rotated, rel_tol=1e-9, abs_tol=1e-12)

    def helps(self) -> bool:
        """The transform lowers the mean attention KL."""
        plain, rotated = self.mean_kl()
        return rotated < plain and not self.changes_nothing()

    def verdict(self) -> str:
        plain, rotated = self.mean_kl()
        if self.changes_nothing():
            return f"{self.transform} leaves the mean attention KL of {self.bits}-bit per-channel keys at {plain:.4f}."
        better = self.helps()
        ratio = max(plain, rotated) / max(min(plain, rotated), 1e-30)
        return (
            f"{self.transform} {'lowers' if better else 'raises'} the mean attention KL of {self.bits}-bit per-channel "
            f"keys, {plain:.4f} → {rotated:.4f} ({ratio:.1f}× {'lower' if better else 'higher'}); it lowers it in "
            f"{self.helped()} of {len(self.layers)} layers. "
            + ("Rotate this model's keys." if better else "Leave this model's keys unrotated (transform='none').")
        )

    def markdown(self) -> str:
        head = (f"{self.model}: {self.bits}-bit keys per channel in groups of {self.group_size}, {self.context} "
                f"tokens of context, {self.queries} queries; plain vs {self.transform}")  # fmt: skip
        columns = [
            "layer",
            "key error",
            "score RMS",
            "attention KL",
            f"query energy on the {WIDE_CHANNELS} widest channels",
        ]
        body = [[str(r.layer), f"{r.key_error[0]:.3f} → {r.key_error[1]:.3f}",
                 f"{r.score_rms[0]:.3f} → {r.score_rms[1]:.3f}", f"{r.attention_kl[0]:.4f} → {r.attention_kl[1]:.4f}",
                 f"{r.wide_share:.1%}"] for r in self.layers]  # fmt: skip
        table = md_table(columns, body, align=["right", "left", "left", "left", "right"])
        return "\n".join([head, "", table, "", self.verdict()])

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "transform": self.transform, "bits": self.bits, "group_size": self.group_size,
                "context": self.context, "queries": self.queries, "verdict": self.verdict(),
                "layers": [vars(r) for r in self.layers]}  # fmt: skip


def _quantized(k: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``k`` ``(1, heads, n, d)`` (``n`` a multiple of ``group_size``) through the torch backend's
    per-channel min-max quantizer, dequantized in float32."""
    from kvpolicy.backends.torch_backend import TorchBackend
    from kvpolicy.formats import MinMax

    backend = TorchBackend()
    return backend.dequantize(backend.quantize(k, MinMax(bits, group_size, "channel", meta_dtype="float16"))).float()


def layer_rotation(
    layer: int, q: torch.Tensor, k: torch.Tensor, scaling: float, quantized: int, transform: Transform, bits: int,
    group_size: int,
) -> LayerRotation:  # fmt: skip
    """Key, score and attention errors of one layer in both bases (see the module docstring).

    Parameters
    ----------
    q : torch.Tensor
        ``(1, q_heads, n_q, d)``: the queries of the last ``n_q`` positions of ``k``.
    k : torch.Tensor
        ``(1, kv_heads, n, d)``: every key; ``q_heads`` is a multiple of ``kv_heads``.
    quantized : int
        The first ``quantized`` keys (a multiple of ``group_size``, at most ``n - n_q + 1``) are quantized.
    """
    q, k = q.float(), k.float()
    n, nq, rep = k.shape[2], q.shape[2], q.shape[1] // k.shape[1]
    head = k[:, :, :quantized]
    plain = _quantized(head, bits, group_size)
    rotated = transform.inverse(_quantized(transform.forward(head), bits, group_size))
    exact = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(rep, 1)) * scaling
    causal = torch.ones(nq, n, dtype=torch.bool, device=k.device).tril(n - nq)
    exact = exact.masked_fill(~causal, float("-inf"))
    logp = exact.log_softmax(-1)
    key_error, score_rms, kls = [], [], []
    for approx in (plain, rotated):
        err = (approx - head).repeat_interleave(rep, 1)
        de = torch.einsum("bhqd,bhkd->bhqk", q, err) * scaling  # score error over the quantized keys
        scores = exact.clone()
        scores[..., :quantized] += de
        logq = scores.log_softmax(-1)
        kl = (logp.exp() * (logp - logq)).nan_to_num(0.0).sum(-1)
        key_error.append(float((approx - head).pow(2).sum() / head.pow(2).sum()))
        score_rms.append(float(de.pow(2).mean().sqrt()))
        kls.append(float(kl.mean()))
    energy = q.pow(2).mean(dim=(0, 2)).reshape(k.shape[1], rep, -1).mean(1)  # (kv_heads, d)
    span = (head.amax(2) - head.amin(2))[0]  # (kv_heads, d)
    wide = span.topk(min(WIDE_CHANNELS, span.shape[-1]), dim=-1).indices
    share = float(torch.gather(energy, 1, wide).sum() / energy.sum())
    return LayerRotation(layer, (key_error[0], key_error[1]), (score_rms[0], score_rms[1]), (kls[0], kls[1]), share)


def capture(
    model: torch.nn.Module, ids: torch.Tensor, queries: int, layers: list[int] | None = None
) -> dict[int, tuple[torch.Tensor, torch.Tensor, float]]:
    """One uncompressed forward of ``ids`` ``(1, n)``; per attention layer (of ``layers``, or all), the
    queries of the last ``queries`` positions ``(1, q_heads, queries, d)``, every key ``(1, kv_heads, n, d)``
    as a cache would store it (after norm and RoPE) and the attention's scaling. The model's attention
    implementation is restored afterwards."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    from kvpolicy.modes import attention_implementation
    from kvpolicy_lab.eval.metrics import last_only

    out: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def keep(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any) -> Any:
        if layers is None or module.layer_idx in layers:
            scaling = kw.get("scaling") or query.shape[-1] ** -0.5
            out[module.layer_idx] = (query[:, :, -queries:].detach().clone(), key.detach().clone(), scaling)
        return sdpa(module, query, key, value, mask, **kw)

    AttentionInterface.register(_CAPTURE, keep)
    AttentionMaskInterface.register(_CAPTURE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    with attention_implementation(model, _CAPTURE), torch.inference_mode():
        model(ids, use_cache=False, **last_only(model))
    return out


def analyze_rotation(
    model: torch.nn.Module,
    tokenizer: Any,
    transform: Transform,
    bits: int = 2,
    group_size: int = 64,
    context: int = 2048,
    queries: int = 64,
    seed: int = 0,
    name: str | None = None,
    files: tuple[str, ...] | None = None,
) -> RotationAnalysis:
    """Measure ``transform``'s effect on ``bits``-bit per-channel keys, layer by layer (module docstring),
    on the ``lm`` task's sample ``seed`` (of ``files``, standard-library file names, when given).

    Raises
    ------
    ConfigError
        If ``context`` holds no whole group, the model has no full-attention layer, ``transform``
        cannot serve the model's head_dim, or its basis fits something per layer (``Transform.fits``: keys
        weighted by the queries, a low-rank part held apart), which the analysis, applying ``forward`` alone,
        would leave out.
    """
    from kvpolicy_lab.eval.caches import analysed_layers
    from kvpolicy_lab.eval.tasks import LanguageModeling

    if context < group_size:
        raise ConfigError(f"analyze rotation: context={context} holds no whole group of group_size={group_size}")
    if transform.fits:
        raise ConfigError(
            f"analyze rotation: transform {transform.name!r} fits something of its own inside the cache's store "
            "(keys weighted by the queries, or a low-rank part held apart), which this analysis of a plain rotation "
            "does not model; analyse 'hadamard', and compare the caches on texts (kvpolicy ablate, "
            "kvpolicy_lab.compare)"
        )
    layers = analysed_layers(model.config, "analyze rotation")
    task = LanguageModeling(samples_per_context=1, tokens=queries, **({"files": files} if files else {}))
    sample = task.samples(tokenizer, context, seed)[0]
    ids = torch.tensor([sample.ids[: context + queries]], device=model.device)
    captured = capture(model, ids, queries, layers)
    quantized = context // group_size * group_size
    result = RotationAnalysis(name or type(model).__name__, repr(transform), bits, group_size, context, queries)
    for layer in sorted(captured):
        q, k, scaling = captured.pop(layer)
        transform.check_head_dim(k.shape[-1])
        result.layers.append(layer_rotation(layer, q, k, scaling, quantized, transform, bits, group_size))
    return result
