"""Where do decoding queries put their attention? (The observation LogQuant is built on.)

A standard-library text is prefilled (``context`` tokens, uncompressed), then ``queries`` more tokens
are decoded teacher-forced with eager attention so that each query's attention weights over every
previous key are available. For every query, layer and query head, the ``top_k`` keys with the
highest weights are the *high-attention keys* ("attention spikes"); their distances ``d = t - j``
from the query are histogrammed in log2 bins (``d = 0``, ``1``, ``2-3``, ``4-7``...). Dividing each
bin's count by its width gives a density per distance: if spikes thin out like ``1/d`` (what a log
window keeps), the density falls by half per bin.

A hybrid model (Gemma-3) is analysed in its full-attention layers only: those are the layers a cache
compresses, and a sliding-window layer's query sees only its window anyway.

Coverage: for the data-independent policies at the same number of full-precision tokens as
``LogWindow(window)`` holds at that length (log, recent sliding window, sinks + recent), the share
of the high-attention keys and of the total attention mass that falls on the tokens the policy keeps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvpolicy.modes import attention_implementation
from kvpolicy_lab.eval.markdown import md_table
from kvpolicy_lab.eval.metrics import last_only
from kvpolicy_lab.eval.tasks import LanguageModeling


@dataclass
class AttentionAnalysis:
    """Result of :func:`analyze_attention`.

    Attributes
    ----------
    histogram : list of list of int
        ``[layer][bin]`` counts of high-attention keys; bin ``b`` holds distances in ``[2**b - 1, 2**(b+1) - 1)``
        (``b = 0``: the query's own key). Rows follow :attr:`layers`.
    coverage : dict
        Policy label -> ``{"topk": share of high-attention keys kept, "mass": share of attention mass kept}``.
    """

    model: str
    context: int
    queries: int
    top_k: int
    window: int
    histogram: list[list[int]]
    coverage: dict[str, dict[str, float]]
    plot: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: indices of the analysed layers (every layer, or a hybrid model's full-attention layers)
    layers: list[int] = field(default_factory=list)

    def layer_name(self, row: int) -> str:
        """The model's index of histogram row ``row``."""
        return str(self.layers[row] if row < len(self.layers) else row)

    def bin_label(self, b: int) -> str:
        lo, hi = 2**b - 1, 2 ** (b + 1) - 2
        return str(lo) if lo == hi else f"{lo}-{hi}"

    def density(self) -> list[float]:
        """High-attention keys per distance (count / bin width), summed over layers, normalized to sum 1."""
        totals = [sum(layer[b] for layer in self.histogram) for b in range(len(self.histogram[0]))]
        dens = [c / 2**b for b, c in enumerate(totals)]
        s = sum(dens) or 1.0
        return [d / s for d in dens]

    def markdown(self) -> str:
        """Tables: share of high-attention keys per distance bin (all layers, and a few single layers), coverage."""
        nbins = len(self.histogram[0])
        totals = [sum(layer[b] for layer in self.histogram) for b in range(nbins)]
        n = sum(totals) or 1
        layers = len(self.histogram)
        pick = sorted({0, layers // 2, layers - 1})
        head = ["distance", "all layers", *[f"layer {self.layer_name(i)}" for i in pick], "density (per token)"]
        dens = self.density()
        body = []
        for b in range(nbins):
            cols = [f"{totals[b] / n:.1%}"]
            for i in pick:
                li = sum(self.histogram[i]) or 1
                cols.append(f"{self.histogram[i][b] / li:.1%}")
            body.append([self.bin_label(b), *cols, f"{dens[b]:.2e}"])
        lines = [md_table(head, body)]
        cov_head = [f"policy (same full-precision count as log W={self.window})", "high-attention keys kept",
                    "attention mass kept"]  # fmt: skip
        cov_body = [[f"`{label}`", f"{v['topk']:.1%}", f"{v['mass']:.1%}"] for label, v in self.coverage.items()]
        cov = ["", md_table(cov_head, cov_body)]
        intro = []
        if self.layers and self.layers != list(range(len(self.layers))):
            intro = [f"Full-attention layers {', '.join(map(str, self.layers))} (the ones a cache compresses; the "
                     "others are sliding-window layers).", ""]  # fmt: skip
        return "\n".join(intro + lines + cov)


def _policies(window: int, full: int) -> dict[str, Any]:
    from kvpolicy.policies.log import LogWindow
    from kvpolicy.policies.recent import RecentWindow
    from kvpolicy.policies.sink import SinkWindow

    return {
        f"log(window={window})": LogWindow(window=window),
        "recent (sliding, same count)": RecentWindow(window=full),
        "sink (4 sinks + recent, same count)": SinkWindow(sinks=4, window=max(1, full - 4)),
    }


@torch.inference_mode()
def analyze_attention(
    model: torch.nn.Module,
    tokenizer: Any,
    context: int = 2048,
    queries: int = 16,
    top_k: int = 8,
    window: int = 42,
    seed: int = 0,
    out: str | Path | None = None,
    progress: bool = False,
    name: str | None = None,
) -> AttentionAnalysis:
    """Histogram the distances of high-attention keys (see the module docstring); plot into ``out``."""
    from transformers import DynamicCache

    from kvpolicy_lab.eval.caches import analysed_layers

    layers = analysed_layers(model.config, "analyze attention")
    sample = LanguageModeling(samples_per_context=1, tokens=queries).samples(tokenizer, context, seed)[0]
    ids = torch.tensor([sample.ids], device=model.device)
    cache = DynamicCache(config=model.config)
    model(ids[:, :context], cache=cache, use_cache=True, **last_only(model))
    nbins = math.floor(math.log2(context + queries)) + 1
    hist: list[list[int]] | None = None
    kept = {}
    cov_topk: dict[str, float] = {}
    cov_mass: dict[str, float] = {}
    total_top = total_mass = 0.0
    with attention_implementation(model, "eager"):  # output_attentions: every weight of every layer
        for t in tqdm(range(context, context + queries), desc="queries", disable=not progress, leave=False):
            outs = model(ids[:, t : t + 1], cache=cache, use_cache=True, output_attentions=True)
            atts = outs.attentions  # per layer (1, heads, 1, keys): every key of a full-attention layer
            if layers is None:
                layers = list(range(len(atts)))
            if hist is None:
                hist = [[0] * nbins for _ in layers]
            length = t + 1
            full = _log_full(window, length)
            for label, policy in _policies(window, len(full)).items():
                state = policy.new_state()
                state.append(length)
                kept[label] = torch.tensor(sorted(state.full_positions()), device=model.device)
            for li, layer in enumerate(layers):
                a = atts[layer]
                if a.shape[-1] != length:
                    raise RuntimeError(
                        f"analyze attention: layer {layer} attended over {a.shape[-1]} keys at position {t}, not "
                        f"{length}; its keys cannot be matched to positions"
                    )
                w = a[0, :, 0, :length].float()  # (heads, keys)
                k = min(top_k, length)
                top = w.topk(k, dim=-1).indices  # (heads, k)
                dist = (t - top).flatten()
                bins = torch.floor(torch.log2(dist.double() + 1)).long().clamp(max=nbins - 1)
                counts = torch.bincount(bins, minlength=nbins)
                for b in range(nbins):
                    hist[li][b] += int(counts[b])
                total_top += top.numel()
                total_mass += float(w.sum())
                for label, pos in kept.items():
                    mask = torch.zeros(length, dtype=torch.bool, device=w.device)
                    mask[pos] = True
                    cov_topk[label] = cov_topk.get(label, 0.0) + float(mask[top].sum())
                    cov_mass[label] = cov_mass.get(label, 0.0) + float(w[:, mask].sum())
    coverage = {k: {"topk": cov_topk[k] / total_top, "mass": cov_mass[k] / total_mass} for k in cov_topk}
    name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
    result = AttentionAnalysis(name, context, queries, top_k, window, hist or [], coverage, layers=layers or [])
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        result.plot = str(plot_analysis(result, out / "attention_spikes.png"))
        (out / "attention_spikes.json").write_text(json.dumps(result.__dict__, indent=1))
        (out / "attention_spikes.md").write_text(result.markdown() + "\n")
    return result


def _log_full(window: int, length: int) -> list[int]:
    from kvpolicy.policies.log import LogWindow

    state = LogWindow(window=window).new_state()
    state.append(length)
    return state.full_positions()


def plot_analysis(result: AttentionAnalysis, path: Path) -> Path:
    """Heat map (layer × log2 distance bin, share per layer) and the density per distance on log-log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = torch.tensor(result.histogram, dtype=torch.float64)
    share = h / h.sum(dim=1, keepdim=True).clamp(min=1)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    im = axes[0].imshow(share.numpy(), aspect="auto", origin="lower", cmap="viridis")
    nb = h.shape[1]
    axes[0].set_xticks(range(nb))
    axes[0].set_xticklabels([result.bin_label(b) for b in range(nb)], rotation=60, fontsize=6)
    axes[0].set_xlabel("distance from the query (tokens, log2 bins)")
    axes[0].set_ylabel("layer")
    if result.layers:
        axes[0].set_yticks(range(len(result.layers)))
        axes[0].set_yticklabels([str(i) for i in result.layers], fontsize=6)
    axes[0].set_title(f"share of top-{result.top_k} keys per layer", fontsize=9)
    fig.colorbar(im, ax=axes[0])
    dens = result.density()
    centers = [max(1.0, (2**b - 1 + 2 ** (b + 1) - 2) / 2) for b in range(nb)]
    axes[1].loglog(centers, [max(d, 1e-9) for d in dens], "o-", label="high-attention keys per token")
    ref = [dens[1] * centers[1] / c for c in centers] if nb > 1 and dens[1] > 0 else []
    if ref:
        axes[1].loglog(centers, ref, "--", label="∝ 1/distance (log window)")
    axes[1].set_xlabel("distance from the query (tokens)")
    axes[1].set_ylabel("density (normalized)")
    axes[1].legend(fontsize=7)
    axes[1].grid(alpha=0.3, which="both")
    fig.suptitle(f"{result.model}: attention spikes, {result.queries} queries after {result.context} tokens",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
