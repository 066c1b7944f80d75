"""``kvpolicy tune``: the composition that fits a bits-per-element budget best, found and checked.

1. **Space.** Compositions built from the parts that measured well (docs/frontier.md): the log
   policy at two windows, with and without four sink tokens; keys min-max per channel (with
   min-max ranges and with fitted ones: ``key_fit`` is written into each candidate, whatever the
   defaults) or one vector per token (centred: scalar codebook indices, or D4 lattice points at 2 and 3
   bits), and values min-max or per-token vectors at several widths; the Hadamard rotation, plain and with
   the keys weighted by the prompt's queries first (``"query-hadamard"``, labels ending in ``-qh``), and on
   request each key's principal part held beside the codes (``"lowrank"``, ``-lr``); and on top
   of each, the boundary layers at 4 bits (compositions without lattice blocks), or a 4-bit codebook
   middle tier
   (:class:`~kvpolicy.actions.tiered.Tiered`, the log rule at ``tier_factors`` times the window:
   four by default).
2. **Bytes.** Each is built and fed random keys and values of the model's shape for ``context``
   tokens and then to the lengths the runs below reach: its bits per element (everything held,
   full-precision tensors at 16 bits) at the largest of them are exact, since none of these policies
   looks at the data. Compositions over the budget are dropped; if
   none fits, the error names the smallest budget that does.
3. **Screening.** Up to ``screen`` compositions under the budget (:func:`pick`: each family in
   turn, nearest the budget first) run the ablation harness's ``lm`` task briefly (one calibration
   text, a few tokens): a cheap ranking. A composition whose measured bytes (after the run's
   tokens) pass the budget is dropped here, and the winner below is chosen among those that stay
   within it in the calibration run too (a check of the simulation: they agree). The budget holds
   at the end of every run; between those lengths the bytes differ by the per-channel staging of
   the keys (fewer than one group of tokens at 16 bits).
4. **Calibration.** The best ``trials`` of the screening (each family in turn) run the ``lm`` task
   on calibration texts (:data:`~kvpolicy_lab.eval.tasks.CALIBRATION_FILES`); the lowest next-token KL wins.
5. **Held out.** The winner and the best single-tier compositions of the calibration (no tiers, no
   per-layer widths) are scored on held-out texts (the ``lm`` task's own files), which chose nothing.

Both runs are resumable run directories under ``out_dir``; a preset TOML file records the winner
(:meth:`kvpolicy.CompressedCache.from_config` loads it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvpolicy.errors import ConfigError
from kvpolicy.formats.base import FITS

#: the log policy's windows searched by default
WINDOWS = (16, 42)
#: (key_bits, value_bits) pairs searched
WIDTHS = ((2, 2), (3, 2), (4, 2), (3, 3), (4, 3), (4, 4))
#: the ranges of min-max keys searched (``Quantize``'s ``key_fit``: both hold the same bytes)
KEY_FITS = ("minmax", "mse")
#: the narrowest keys searched with the codebook scheme (per token, centred: ``key_centre=True``)
KEY_CODEBOOK_BITS = 2
#: the schemes of per-token vectors (a scale per vector; rotated data only) searched for keys and values:
#: Lloyd-Max indices per coordinate, and D4 lattice points per four coordinates (at LATTICE_BITS only)
VECTOR_SCHEMES = ("codebook", "lattice")
#: the letter of each vector scheme in a label (``k3cm``: centred 3-bit codebook keys, ``v2l``: lattice values)
SCHEME_CODES = {"codebook": "c", "lattice": "l"}
#: the transforms a search can try where the rotation is: plain, with keys weighted by the prompt's queries first,
#: and with each key's rank-8 principal part held beside the codes (docs/explanation/transforms.md, "Weighting
#: keys by the queries" and "Holding the keys' principal directions apart")
TRANSFORMS = ("hadamard", "query-hadamard", "lowrank")
#: the ones searched unless asked: the low-rank part lost at equal bits on the models measured, and each transform
#: tried multiplies the candidates
DEFAULT_TRANSFORMS = ("hadamard", "query-hadamard")
#: the end of the label of each transform
TRANSFORM_CODES = {"hadamard": "", "query-hadamard": "-qh", "lowrank": "-lr"}
#: what the boundary layers and a middle tier hold
HIGH_BITS = 4
#: boundary layers held at HIGH_BITS: the first and the last this many full-attention layers
BOUNDARY = 2
#: a middle tier keeps what the log rule at this many times the policy's window keeps
TIER_FACTORS = (4,)
#: the widths of codebook scales searched: one-byte scales hold 8 / head_dim bits per element less for the
#: same quality (docs/explanation/quantization.md, "One-byte scales")
NORM_BITS = (8,)
#: the widths a codebook scale can take (``Quantize(norm_bits=...)``)
NORM_BITS_ALLOWED = (16, 8)


@dataclass
class Candidate:
    """One composition: a label, its ``CompressedCache`` keywords and its family."""

    label: str
    args: dict[str, Any]
    family: str  # "single", "boundary" or "tiered"
    bits: float = math.nan
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # run -> {"kl", "top1", "bits"}


def space(
    attention_layers: list[int], windows: tuple[int, ...] = WINDOWS, key_groups: tuple[int, ...] = (64,),
    tier_factors: tuple[int, ...] = TIER_FACTORS, rotate: bool = True, key_fits: tuple[str, ...] = KEY_FITS,
    norm_bits: tuple[int, ...] = NORM_BITS, schemes: tuple[str, ...] = VECTOR_SCHEMES,
    transforms: tuple[str, ...] = DEFAULT_TRANSFORMS,
) -> Iterator[Candidate]:  # fmt: skip
    """Every composition searched, for a model whose full-attention layers are ``attention_layers``;
    ``key_groups``: the group sizes of the keys (per channel) tried, each with every range fit of
    ``key_fits`` (``"minmax"``, ``"mse"``: labels of fitted ones end in ``-kmse``); ``tier_factors``: a
    middle tier keeps what the log rule at each of these multiples of the window keeps (one candidate each).
    ``rotate=False`` (a model whose keys the rotation hurts: :func:`rotation_helps`) searches without
    the Hadamard rotation: min-max keys and values only (the codebook scheme needs the rotation), a
    4-bit min-max middle tier with keys per token, labels ending in ``-norot``. ``norm_bits``: the widths of
    the per-vector scales of codebook blocks tried (``Quantize(norm_bits=...)``), each a candidate of its
    own where a composition holds codebook or lattice blocks (labels of one-byte scales end in ``-n8``).
    ``schemes``: the per-token vector schemes tried for keys and values (:data:`VECTOR_SCHEMES`; the
    lattice at 2 and 3 bits only, so never on the boundary layers' 4 bits: a composition with lattice
    blocks has no boundary twin). ``transforms``: the rotations each rotated composition is tried with
    (a selection of :data:`TRANSFORMS`, by default :data:`DEFAULT_TRANSFORMS`; ``"query-hadamard"`` labels end in
    ``-qh``, ``"lowrank"`` ones in ``-lr``).

    Raises
    ------
    ConfigError
        If a tier factor is not an integer of at least 2 (the middle tier's window must exceed the
        policy's, or the tier keeps nothing the policy did not already), or ``key_fits`` is empty or
        names a fit other than ``"minmax"`` and ``"mse"``, or ``norm_bits`` is empty or holds a width
        other than 16 and 8, or ``schemes`` is empty or names a scheme other than those of
        :data:`VECTOR_SCHEMES`, or ``transforms`` is empty or names one other than those of :data:`TRANSFORMS`.
    """
    if not transforms or any(t not in TRANSFORMS for t in transforms):
        raise ConfigError(
            f"tune: transforms must be a non-empty selection of {list(TRANSFORMS)}; got {list(transforms)!r}"
        )
    if not schemes or any(s not in VECTOR_SCHEMES for s in schemes):
        raise ConfigError(
            f"tune: vector schemes must be a non-empty selection of {list(VECTOR_SCHEMES)}; got {list(schemes)!r}"
        )
    if not norm_bits or any(isinstance(n, bool) or n not in NORM_BITS_ALLOWED for n in norm_bits):
        raise ConfigError(
            f"tune: norm bits must be a non-empty selection of {list(NORM_BITS_ALLOWED)}; got {list(norm_bits)!r}"
        )
    if not key_fits or any(f not in FITS for f in key_fits):
        raise ConfigError(f"tune: key fits must be a non-empty selection of {list(FITS)}; got {list(key_fits)!r}")
    for f in tier_factors:
        if not isinstance(f, int) or isinstance(f, bool) or f < 2:
            raise ConfigError(f"tune: tier factors must be integers >= 2 (W' = factor x W > W); got {f!r}")
    boundary = sorted({*attention_layers[:BOUNDARY], *attention_layers[-BOUNDARY:]})
    for window in windows:
        for sinks in (0, 4):
            for kb, vb in WIDTHS:
                # codebook keys (per token, no group, centred) at every width: centred, they lose less than
                # min-max per channel at fewer bytes (docs/explanation/quantization.md)
                keys = [("minmax", kg, fit) for kg in key_groups for fit in dict.fromkeys(key_fits)]
                if rotate and kb >= KEY_CODEBOOK_BITS:
                    keys += [(s, None, None) for s in _vector_schemes(schemes, kb)]
                for kscheme, kg, fit in keys:
                    for vscheme in ("minmax", *_vector_schemes(schemes, vb)) if rotate else ("minmax",):
                        for cand in _variants(window, sinks, kb, vb, kg, kscheme, vscheme, boundary, tier_factors,
                                              rotate, fit):  # fmt: skip
                            for c in _with_norm_bits(cand, norm_bits):
                                yield from _with_transforms(c, transforms)


def _serves(scheme: str, bits: int) -> bool:
    """Whether blocks of ``scheme`` (min-max or a vector scheme) hold ``bits``-bit codes (the format's
    ``bits_allowed``; the lattice comes from the research plugin: pip install ./plugins/kvpolicy-research)."""
    from kvpolicy import registry

    return scheme == "minmax" or bits in registry.get("formats", scheme).bits_allowed


def _vector_schemes(schemes: tuple[str, ...], bits: int) -> list[str]:
    """The schemes of ``schemes`` that serve ``bits``-bit vectors, each once."""
    return [s for s in dict.fromkeys(schemes) if _serves(s, bits)]


def _with_norm_bits(cand: Candidate, widths: tuple[int, ...]) -> Iterator[Candidate]:
    """``cand`` once per width of ``widths`` its codebook scales can take (once as it is when it holds no
    codebook block)."""
    quants = cand.args.get("tiers", []) if cand.args.get("action") == "tiered" else [cand.args]
    if not any(_has_scaled(q) for q in quants):
        yield cand
        return
    for width in dict.fromkeys(widths):
        if width == 16:
            yield cand
            continue
        args = dict(cand.args)
        if args.get("action") == "tiered":
            args["tiers"] = [{**t, "norm_bits": width} if _has_scaled(t) else t for t in args["tiers"]]
        else:
            args["norm_bits"] = width
        label = cand.label.removesuffix("-norot")
        suffix = "-norot" if label != cand.label else ""
        yield Candidate(f"{label}-n{width}{suffix}", args, cand.family)


def _with_transforms(cand: Candidate, transforms: tuple[str, ...]) -> Iterator[Candidate]:
    """``cand`` once per rotation of ``transforms`` (as it is when it is not rotated)."""
    if cand.args.get("transform") != "hadamard":
        yield cand
        return
    for t in dict.fromkeys(transforms):
        yield Candidate(cand.label + TRANSFORM_CODES[t], {**cand.args, "transform": t}, cand.family)


def _has_scaled(quant: dict[str, Any]) -> bool:
    """Whether ``quant`` holds blocks with a scale per vector (codebook or lattice), which take ``norm_bits``."""
    return any(quant.get(k) in SCHEME_CODES for k in ("scheme", "key_scheme", "value_scheme"))


def _variants(
    window: int, sinks: int, kb: int, vb: int, kg: int | None, kscheme: str, vscheme: str, boundary: list[int],
    tier_factors: tuple[int, ...] = TIER_FACTORS, rotate: bool = True, fit: str | None = None,
) -> Iterator[Candidate]:  # fmt: skip
    quant: dict[str, Any] = {"key_bits": kb, "value_bits": vb}
    if kg is not None:  # min-max keys: their group size and fit, whatever the defaults
        quant.update(key_group_size=kg, key_fit=fit or "minmax")
    if kscheme in SCHEME_CODES:
        quant.update(key_scheme=kscheme, key_centre=True)
    if vscheme in SCHEME_CODES:
        quant["value_scheme"] = vscheme
    base: dict[str, Any] = {"policy": "log", "window": window, "transform": "hadamard" if rotate else "none"}
    if sinks:
        base["sinks"] = sinks
    code = SCHEME_CODES.get(vscheme, "")
    kcode = f"{SCHEME_CODES[kscheme]}m" if kscheme in SCHEME_CODES else ""
    group = f"g{kg}" if kg is not None and kg != 64 else ""
    fitted = "-kmse" if fit == "mse" else ""
    name = f"log{window}{f'-s{sinks}' if sinks else ''}-k{kb}{kcode}{group}v{vb}{code}{fitted}"
    suffix = "" if rotate else "-norot"
    yield Candidate(name + suffix, {**base, **quant}, "single")
    if min(kb, vb) >= HIGH_BITS:
        return
    if _serves(kscheme, HIGH_BITS) and _serves(vscheme, HIGH_BITS):  # the boundary layers hold HIGH_BITS
        layer_bits = {str(i): HIGH_BITS for i in boundary}
        yield Candidate(f"{name}-b{HIGH_BITS}{suffix}", {**base, **quant, "layer_bits": layer_bits}, "boundary")
    # a middle tier's tokens leave it one at a time: per-token keys (codebook, or min-max per token)
    middle = {"bits": HIGH_BITS, "scheme": "codebook", "key_centre": True} if rotate else \
        {"bits": HIGH_BITS, "key_axis": "token", "fit": "minmax"}  # fmt: skip
    tiers = [middle, quant]
    for factor in dict.fromkeys(tier_factors):
        keep = [{"name": "log", "window": factor * window}]
        args = {**base, "action": "tiered", "tiers": tiers, "keep": keep}
        yield Candidate(f"{name}-t{HIGH_BITS}x{factor * window}{suffix}", args, "tiered")


def rotation_helps(model: torch.nn.Module, tokenizer: Any, context: int, seed: int = 0) -> tuple[bool, str]:
    """Whether the Hadamard rotation lowers the attention KL of this model's 2-bit per-channel keys
    (:func:`kvpolicy_lab.eval.rotation_analysis.analyze_rotation`, on a calibration text, never a held-out
    one), and the analysis's verdict."""
    from kvpolicy.transforms import Hadamard
    from kvpolicy_lab.eval.rotation_analysis import analyze_rotation
    from kvpolicy_lab.eval.tasks import CALIBRATION_FILES

    result = analyze_rotation(model, tokenizer, Hadamard(0), bits=2, context=context, seed=seed,
                              files=CALIBRATION_FILES)  # fmt: skip
    return result.helps(), result.verdict()


def simulated_bits(
    args: dict[str, Any], config: Any, context: int, extra: tuple[int, ...] = (1,), seed: int = 0
) -> float:
    """The most bits per element a composition holds after ``context + e`` tokens, for each ``e`` of
    ``extra`` (full-precision tensors counted at 16 bits), fed random keys and values of the model's
    shape (one batch row). None of the searched policies looks at the data, so this is what a model
    run of those lengths holds. A hybrid model's figure counts its full-attention layers, the ones a cache
    compresses (:func:`~kvpolicy_lab.eval.caches.budget_bits`: the sliding-window layers stay transformers'
    own at 16 bits whatever the composition)."""
    from kvpolicy.cache import CompressedCache
    from kvpolicy_lab.estimation import feed_random_queries
    from kvpolicy_lab.eval.caches import budget_bits

    text = config.get_text_config(decoder=True)
    heads = text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    cache = CompressedCache(**args, config=config, backend="torch")
    g = torch.Generator().manual_seed(seed)
    most, length = 0.0, 0
    for target in sorted({context, *(context + e for e in extra)}):
        step = target - length
        for i in range(len(cache.layers)):  # sliding-window layers (transformers' own) included
            x = torch.randn(1, heads, step, head_dim, generator=g)
            cache.update(x, x, i)
            feed_random_queries(cache.layers[i], x, g)  # a store fitted on the queries gets random ones
        length = target
        if target > context or not extra:
            most = max(most, budget_bits(cache, config, target))
    return most


def storage_key(args: dict[str, Any]) -> str:
    """``args`` without the keys' range fit (``key_fit``, in tiers too): compositions with the same key
    hold the same bytes at every length (a fitted range is stored like a min-max one), so
    :func:`simulated_bits` runs once per key."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "key_fit"}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return json.dumps(strip(args), sort_keys=True)


def attention_layers(config: Any) -> list[int]:
    """Indices of the layers a ``CompressedCache(config=config)`` compresses."""
    text = config.get_text_config(decoder=True)
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return [i for i, kind in enumerate(kinds) if kind == "full_attention"]


def within_budget(candidates: list[Candidate], budget: float) -> list[Candidate]:
    """The candidates at or under ``budget`` bits per element, nearest the budget first.

    Raises
    ------
    ConfigError
        If none fits: the message names the smallest budget that does.
    """
    fitting = [c for c in candidates if c.bits <= budget]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.bits)
        raise ConfigError(
            f"--budget-bits {budget:g}: no composition of the search fits; the smallest holds {smallest.bits:.3f} "
            f"bits per element ({smallest.label}). Pass --budget-bits {math.ceil(smallest.bits * 100) / 100:g} or more."
        )
    return sorted(fitting, key=lambda c: (-c.bits, c.label))


def measured_bits(c: Candidate) -> float:
    """The most bits per element the screening and calibration runs of ``c`` measured (after their tokens),
    else the simulated figure."""
    measured = [run["bits"] for name, run in c.scores.items() if name != "heldout" and "bits" in run]
    return max(measured) if measured else c.bits


def measured_within(candidates: list[Candidate], budget: float, stage: str) -> list[Candidate]:
    """The candidates whose runs so far measured at most ``budget`` bits per element.

    Raises
    ------
    ConfigError
        If none did (``stage`` names the candidates in the message: "screened", "calibrated").
    """
    fits = [c for c in candidates if measured_bits(c) <= budget]
    if not fits:
        least = min(measured_bits(c) for c in candidates)
        raise ConfigError(
            f"--budget-bits {budget:g}: every {stage} composition measured more after its tokens (per-channel key "
            f"staging varies with the length); the least was {least:.3f}. Pass a larger budget."
        )
    return fits


def pick(ranked: list[Candidate], n: int, nearest: bool = True) -> list[Candidate]:
    """``n`` of ``ranked`` (best first): the families (single, boundary, tiered) in turn, each family's
    best first, so that every family is tried (and single-tier rivals exist). Returned nearest the
    budget first (``nearest``) or in ``ranked`` order."""
    families: dict[str, list[Candidate]] = {}
    for c in ranked:
        families.setdefault(c.family, []).append(c)
    order = [families[f] for f in ("single", "boundary", "tiered") if f in families]
    picked: list[Candidate] = []
    while len(picked) < n and any(order):
        for queue in order:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    if nearest:
        return sorted(picked, key=lambda c: (-c.bits, c.label))
    return [c for c in ranked if c in picked]


def grid(
    model: str, context: int, caches: list[Candidate], lm: dict[str, Any], dtype: str, device: str, batch: int = 1
) -> dict:
    """An ablation grid (:func:`kvpolicy_lab.eval.grid.grid_from_dict`) of ``caches`` on the ``lm`` task, decoding
    up to ``batch`` texts together, without the attention-error probe (the search reads KL, top-1 and
    bytes only)."""
    return {
        "models": [model], "dtype": dtype, "device": device, "contexts": [context], "seed": 0, "replay": True,
        "equal_bytes": False, "attention_error": False, "batch": batch, "tasks": {"lm": lm},
        "caches": [{"label": "uncompressed", "kind": "dynamic"}] + [{"label": c.label, **c.args} for c in caches],
    }  # fmt: skip


def read_scores(run_dir: Path) -> dict[str, dict[str, float]]:
    """``{cache label: {"kl", "kl_se", "top1", "bits"}}`` from a run directory's results; ``bits`` counts a hybrid
    model's full-attention layers (``bits_per_element_16_global``), as the budget does."""
    out: dict[str, dict[str, float]] = {}
    names = {"kl": "kl", "top1": "top1", "bits_per_element_16": "bits", "bits_per_element_16_global": "global"}
    for line in (run_dir / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("task") == "lm" and row.get("metric") in names:
            entry = out.setdefault(row["cache"], {})
            entry[names[row["metric"]]] = float(row["value"])
            if row["metric"] == "kl" and row.get("se") is not None:
                entry["kl_se"] = float(row["se"])
    for entry in out.values():
        if "global" in entry:
            entry["bits"] = entry.pop("global")
    return out


def preset_toml(candidate: Candidate, info: dict[str, Any]) -> str:
    """The preset file: the ``[cache]`` keywords and a ``[tune]`` record of how they were found."""
    import tomli_w

    return tomli_w.dumps({"cache": candidate.args, "tune": info})


def frontier_table(rows: list[Candidate], chosen: Candidate) -> str:
    """A markdown table of the evaluated candidates, the chosen one marked ★."""
    from kvpolicy_lab.eval.markdown import md_table

    head = ["composition", "bits/el (simulated)", "bits/el (measured)", "calibration KL", "held-out KL (± s.e.)",
            "held-out top-1"]  # fmt: skip
    body = []
    for c in sorted(rows, key=lambda c: c.bits):
        cal = c.scores.get("calibration", {})
        if not cal:
            continue
        held = c.scores.get("heldout", {})
        mark = " ★" if c is chosen else ""
        held_kl = f"{held['kl']:.4f} ± {held.get('kl_se', math.nan):.4f}" if "kl" in held else "–"
        top1 = f"{100 * held['top1']:.1f} %" if "top1" in held else "–"
        body.append([f"`{c.label}`{mark}", f"{c.bits:.3f}", f"{measured_bits(c):.3f}", f"{cal.get('kl', math.nan):.4f}",
                     held_kl, top1])  # fmt: skip
    return md_table(head, body)
