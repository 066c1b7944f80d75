"""Named compositions: ``CompressedCache.from_preset(name, **overrides)``.

Published methods as their papers run them (``logquant``, ``kivi``, ``h2o``, ``streamingllm``), and
kvpolicy's own best measured compositions by bit budget (``kvpolicy-3bit``, ``-3.5bit``, ``-4bit``,
``-4.5bit``: the frontier of docs/frontier.md). A preset is a function returning the keyword arguments of
:class:`~kvpolicy.cache.CompressedCache`;
:meth:`kvpolicy.spec.CacheSpec.from_preset` resolves it, with overrides, into a spec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpolicy import builtins
from kvpolicy.actions.quantize import Quantize
from kvpolicy.policies.base import check_int
from kvpolicy.policies.log import LogWindow


def logquant(budget: int = 128, bits: int = 2, group_size: int = 64) -> dict[str, Any]:
    """LogQuant as run in its paper (Chen et al., "LogQuant: Log-Distributed 2-Bit Quantization
    of KV Cache with Superior Accuracy Preservation", arXiv 2503.19950, ICLR 2025 SLLM workshop).

    ``budget`` reserved full-precision tokens give the window ``W = budget // 3`` (128 -> 42,
    192 -> 64, 256 -> 85); demoted keys and values are quantized to 2 bits with per-token groups
    of 64 channels (the paper's setting for both K and V; the library default instead groups keys
    per channel, which is more accurate).
    """
    check_int("budget", budget, 3, "preset 'logquant'")
    return {
        "policy": LogWindow(window=budget // 3),
        "action": Quantize(bits=bits, group_size=group_size, key_axis="token", value_axis="token", fit="minmax"),
    }


def logquant_4bit(budget: int = 128, group_size: int = 64) -> dict[str, Any]:
    """LogQuant at 4 bits (same paper, arXiv 2503.19950): ``W = budget // 3``, per-token groups
    of 64 for K and V. The paper reports 4-bit KV caches as essentially lossless for both LogQuant
    and its KiVi baseline.
    """
    return logquant(budget=budget, bits=4, group_size=group_size)


def kivi(bits: int = 2, group_size: int = 32, residual: int = 128) -> dict[str, Any]:
    """KIVI as released by its authors (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit
    Quantization for KV Cache", ICML 2024, arXiv 2402.02750): 2-bit keys grouped per channel and
    values per token, groups of 32, a full-precision residual of R = 128 recent tokens flushed
    R at a time, and the last ``L mod R`` prompt tokens kept at full precision. Each token is
    quantized once (append-only), unlike transformers' ``QuantizedCache``, which the LogQuant
    paper calls "KiVi" (whole prompt quantized, history re-quantized at every flush); for that
    baseline's selection use ``policy="recent", variant="flush", prompt="quantize"``.
    """
    from kvpolicy.policies.recent import RecentWindow

    return {
        "policy": RecentWindow(window=residual, variant="flush", prompt="keep_tail"),
        "action": Quantize(bits=bits, group_size=group_size, key_axis="channel", value_axis="token", fit="minmax"),
    }


def h2o(budget: int = 256) -> dict[str, Any]:
    """H2O, heavy-hitter eviction (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient
    Generative Inference of Large Language Models", NeurIPS 2023, arXiv 2306.14048): a cache of
    ``budget`` tokens split equally between heavy hitters (highest accumulated attention) and the
    most recent tokens, as in the paper's main experiments; the rest is evicted. Needs attention
    scores: call :func:`kvpolicy.attention.enable_scores` on the model first.
    """
    from kvpolicy.actions.evict import Evict
    from kvpolicy.policies.h2o import HeavyHitters

    check_int("budget", budget, 2, "preset 'h2o'")
    return {"policy": HeavyHitters(heavy=budget // 2, recent=budget - budget // 2), "action": Evict()}


def streamingllm(budget: int = 1024, sinks: int = 4) -> dict[str, Any]:
    """StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
    ICLR 2024, arXiv 2309.17453): the first ``sinks = 4`` tokens (attention sinks) plus the most
    recent ``budget - sinks`` tokens; everything in between is evicted.
    """
    from kvpolicy.actions.evict import Evict
    from kvpolicy.policies.sink import SinkWindow

    check_int("budget", budget, sinks + 1, "preset 'streamingllm'")
    return {"policy": SinkWindow(sinks=sinks, window=budget - sinks), "action": Evict()}


def _tiered(
    name: str, window: int, middle_window: int, key_bits: int, value_bits: int, seed: int, norm_bits: int
) -> dict[str, Any]:
    """The composition of kvpolicy's own presets: the log policy with W = ``window`` at full precision,
    then two tiers of codebook blocks with centred keys (``key_centre=True``) and ``norm_bits``-bit
    scales: 4-bit keys and values for the demoted tokens that the log rule at W′ = ``middle_window``
    keeps, ``key_bits`` keys and ``value_bits`` values for the rest (a token moving down is re-quantized
    from its 4-bit reconstruction), and the Hadamard rotation (``seed``)."""
    from kvpolicy.actions.tiered import Tiered
    from kvpolicy.transforms.hadamard import Hadamard

    check_int("window", window, 1, f"preset {name!r}")
    check_int("middle_window", middle_window, 1, f"preset {name!r}")
    tiers = [
        Quantize(bits=4, scheme="codebook", key_centre=True, norm_bits=norm_bits),
        Quantize(key_bits=key_bits, value_bits=value_bits, scheme="codebook", key_centre=True, norm_bits=norm_bits),
    ]
    return {
        "policy": LogWindow(window=window),
        "action": Tiered(tiers=tiers, keep=[LogWindow(window=middle_window)]),
        "transform": Hadamard(seed=seed),
    }


def kvpolicy_3bit(window: int = 4, middle_window: int = 32, seed: int = 0, norm_bits: int = 8) -> dict[str, Any]:
    """kvpolicy's best measured composition at or under 3.0 bits per element: the log policy with
    W = ``window`` at full precision, then two tiers of codebook blocks with centred keys
    (``key_centre=True``) and one-byte scales (``norm_bits``): 4-bit keys and values for the tokens the
    log rule at W′ = ``middle_window`` keeps among the demoted ones, 3-bit keys and 2-bit values for the
    rest (a token moving down is re-quantized from its 4-bit reconstruction), and the Hadamard rotation
    (``seed``). Measured on SmolLM2-135M at 2k context on the texts of docs/frontier.md (cache
    ``log4-k3cmv2c-t44x32-n8``): 2.84 bits, KL 0.031 (worst text 0.047), top-1 93.6 %; with 16-bit
    scales (``norm_bits=16``, cache ``log4-k3cmv2c-t44x32``) 2.97 bits for the same KL. Not a published
    method: a composition of kvpolicy's parts, chosen on calibration texts and measured on the frontier's.
    """
    return _tiered("kvpolicy-3bit", window, middle_window, 3, 2, seed, norm_bits)


def kvpolicy_3_5bit(window: int = 4, middle_window: int = 32, seed: int = 0, norm_bits: int = 8) -> dict[str, Any]:
    """kvpolicy's best measured composition at or under 3.5 bits per element: ``kvpolicy-3bit`` with
    3-bit codebook values in the bottom tier (log W = ``window``; centred 4-bit codebook keys and
    values for the tokens the log rule at W′ = ``middle_window`` keeps; centred 3-bit codebook keys
    and 3-bit codebook values below; ``norm_bits``-bit scales; Hadamard, ``seed``). Measured on
    SmolLM2-135M at 2k context (docs/frontier.md, cache ``log4-k3cmv3c-t44x32-n8``): 3.32 bits, KL
    0.021 (worst text 0.031), top-1 93.7 % (16-bit scales: 3.45 bits for the same KL). Not a published
    method: a composition of kvpolicy's parts, chosen on calibration texts and measured on the
    frontier's.
    """
    return _tiered("kvpolicy-3.5bit", window, middle_window, 3, 3, seed, norm_bits)


def kvpolicy_4bit(window: int = 4, middle_window: int = 32, seed: int = 0, norm_bits: int = 8) -> dict[str, Any]:
    """kvpolicy's best measured composition at or under 4.0 bits per element: ``kvpolicy-3bit`` with
    4-bit keys and 3-bit values in the bottom tier (log W = ``window``; centred 4-bit codebook keys
    and values for the tokens the log rule at W′ = ``middle_window`` keeps; centred 4-bit codebook
    keys and 3-bit codebook values below; ``norm_bits``-bit scales; Hadamard, ``seed``). Measured on
    SmolLM2-135M at 2k context (docs/frontier.md, cache ``log4-k4cmv3c-t44x32-n8``): 3.80 bits, KL
    0.010 (worst text 0.014), top-1 95.4 % (16-bit scales: 3.93 bits for the same KL). Not a published
    method: a composition of kvpolicy's parts, chosen on calibration texts and measured on the
    frontier's.
    """
    return _tiered("kvpolicy-4bit", window, middle_window, 4, 3, seed, norm_bits)


def kvpolicy_4_5bit(window: int = 4, seed: int = 0, norm_bits: int = 8) -> dict[str, Any]:
    """kvpolicy's best measured composition at or under 4.5 bits per element, for near-lossless
    caches: the log policy with W = ``window`` at full precision, 4-bit min-max keys per channel
    (groups of 64 tokens) and 3-bit codebook values (one ``norm_bits``-bit scale per token and head), and
    the Hadamard rotation (``seed``). One tier: at 4 bits per-channel min-max keys beat the codebook keys
    of the tiered presets. Measured on SmolLM2-135M at 2k context (docs/frontier.md, cache
    ``log4-k4v3c-n8``): 4.01 bits, KL 0.0074 (worst text 0.0098), top-1 95.7 % (16-bit scales: 4.07 bits,
    KL 0.0073), against transformers' ``QuantizedCache(quanto, 4)`` at 5.13 bits and KL 0.019. Rotation
    helps SmolLM2's keys and hurts Gemma-3's: ``kvpolicy analyze rotation`` tells for a model. Not a
    published method: a composition of kvpolicy's parts, chosen on calibration texts
    (scripts/codebook_probes.py) and measured on the frontier's.
    """
    from kvpolicy.transforms.hadamard import Hadamard

    check_int("window", window, 1, "preset 'kvpolicy-4.5bit'")
    return {
        "policy": LogWindow(window=window),
        "action": Quantize(
            key_bits=4, value_bits=3, value_scheme="codebook", key_group_size=64, key_fit="minmax", norm_bits=norm_bits
        ),
        "transform": Hadamard(seed=seed),
    }


#: the built-in presets by name (registered in :mod:`kvpolicy.builtins`)
BUILTIN_PRESETS: dict[str, Callable[..., dict[str, Any]]] = {
    name: globals()[fn] for name, fn in builtins.PRESETS.items()
}
