"""Short readable names of a grid's caches, for plots: ``log W16, K3/V2, rotated`` for ``log16-k3v2-rot``.

A grid names its caches by compact labels (``log4-k3cmv2c-t44x32``) that its tables use as ids;
:func:`composition_name` spells one cache's composition out from its entry in the run's
``config.json`` (``{"label", "kind", "args"}``), leaving the defaults unsaid: min-max groups of 64
(keys per channel, values per token), no rotation. Distinct compositions get distinct names (the transform
included), so that no two points of a plot share one.
"""

from __future__ import annotations

from typing import Any

from kvpolicy.errors import ConfigError

#: published caches kvpolicy ships as presets, by preset name
PUBLISHED = {"logquant": "LogQuant", "kivi": "KIVI"}
#: transformers' quantized-cache backends as their projects write them
HF_BACKEND_NAMES = {"quanto": "quanto", "hqq": "HQQ"}
#: kvpolicy's shipped presets, their bit budget and the label of their cell in the committed config (the frontier
#: page and the plots name those cells by the preset; tests/test_frontier_report.py checks that each preset builds
#: exactly that cell's cache)
PRESET_CELLS = {
    "kvpolicy-3bit": (3.0, "log4-k3cmv2c-t44x32-n8"),
    "kvpolicy-3.5bit": (3.5, "log4-k3cmv3c-t44x32-n8"),
    "kvpolicy-4bit": (4.0, "log4-k4cmv3c-t44x32-n8"),
    "kvpolicy-4.5bit": (4.5, "log4-k4v3c-n8"),
}
#: the preset named for each cell of :data:`PRESET_CELLS`
PRESET_NAMES = {cell: name for name, (_, cell) in PRESET_CELLS.items()}


def composition_name(entry: dict[str, Any]) -> str:
    """The readable name of one grid cache.

    Parameters
    ----------
    entry : dict
        The cache's entry in ``config.json``'s ``caches``: ``kind`` (``compressed``, ``preset``,
        ``dynamic`` or ``hf-quantized``), ``args`` and ``label``.

    Returns
    -------
    str
        E.g. ``"log W42, K2/V2, rotated"``, ``"sink 4+12, K4/V4"``, ``"log W8, K3/V2 codebook, centred
        keys"``, ``"transformers quanto 2-bit"``, ``"LogQuant"``; the label itself for a kind or
        policy it does not know.
    """
    if not isinstance(entry, dict) or not isinstance(entry.get("args", {}), dict):
        raise ConfigError(f"composition_name entry must be a config.json cache entry (a dict with args); got {entry!r}")
    kind, a, label = entry.get("kind", "compressed"), entry.get("args", {}), str(entry.get("label", "?"))
    if kind == "dynamic":
        return "uncompressed"
    if kind == "hf-quantized":
        return f"transformers {HF_BACKEND_NAMES.get(a.get('backend'), a.get('backend'))} {a.get('nbits', 4)}-bit"
    if kind == "preset":
        return PUBLISHED.get(a.get("name"), str(a.get("name", label)))
    if kind != "compressed":
        return label
    selection = _selection(a)
    if selection is None:
        return label
    if a.get("action") == "tiered" and a.get("tiers"):
        low, mid = a["tiers"][-1], a["tiers"][0]
        keep = (a.get("keep") or [{}])[0]
        parts = [selection, *_quantizer(low, a), f"{mid.get('bits', '?')}-bit tier W′{keep.get('window', '?')}"]
    elif a.get("action", "quantize") == "quantize":
        parts = [selection, *_quantizer(a, a)]
    else:
        parts = [selection, str(a["action"])]
    return ", ".join(parts)


def _selection(a: dict[str, Any]) -> str | None:
    """``log W42``, ``log W8 + 4 sinks``, ``sink 4+38``, ``recent 128``; None for another policy."""
    policy, window, sinks = a.get("policy", "log"), a.get("window"), a.get("sinks")
    if policy == "log":
        return f"log W{window}" + (f" + {sinks} sinks" if sinks else "")
    if policy == "sink":
        return f"sink {sinks if sinks is not None else 4}+{window}"
    if policy == "recent":
        return f"recent {window}"
    return None


def _quantizer(q: dict[str, Any], whole: dict[str, Any]) -> list[str]:
    """The bit widths and every setting off the default, of quantizer arguments ``q`` (``whole``: the
    cache's arguments, for the transform)."""
    kb = q.get("key_bits", q.get("bits", "?"))
    vb = q.get("value_bits", q.get("bits", "?"))
    scheme = q.get("scheme", "minmax")
    key_s, value_s = q.get("key_scheme", scheme), q.get("value_scheme", scheme)
    if key_s == value_s and key_s != "minmax":
        out = [f"K{kb}/V{vb} {key_s}"]
    else:
        out = [f"K{kb}/V{vb}"] + [f"{s} {role}" for s, role in ((key_s, "keys"), (value_s, "values")) if s != "minmax"]
    if q.get("key_centre"):
        out.append("centred keys")
    if q.get("norm_bits") == 8:
        out.append("1-byte scales")
    transform = whole.get("transform", "none")
    if transform == "hadamard" and key_s == value_s == "minmax":  # the other schemes are always rotated
        out.append("rotated")
    elif transform == "query-hadamard":
        out.append("query-weighted keys")
    elif transform == "lowrank":
        out.append(f"low-rank keys (rank {whole.get('rank', '?')})")
    if q.get("key_group_size", 64) != 64:
        out.append(f"key groups {q['key_group_size']}")
    if q.get("fit") == "mse":
        out.append("MSE fit")
    elif q.get("key_fit") == "mse":
        out.append("key MSE fit")
    return out


def composition_names(caches: list[dict[str, Any]]) -> dict[str, str]:
    """:func:`composition_name` of every entry of ``config.json``'s ``caches``, by label."""
    return {str(c["label"]): composition_name(c) for c in caches if isinstance(c, dict) and "label" in c}
