"""Bytes before running: what a :class:`~kvpolicy.cache.CompressedCache` will hold after a prompt.

:func:`estimate` answers, for a model's config, a prompt length and a composition (a preset name,
cache keywords or an unused cache), the bytes :meth:`CompressedCache.memory_report` would report
after a prefill of that many tokens, without the model: no weights are loaded and no forward runs.

How: a fresh cache is built with ``config=`` (so sliding-window layers stay transformers' own, as
in a real run), and for each *distinct* layer (layers usually share one composition; ``layer_bits``
and sliding layers make more) synthetic keys and values of shape ``(1, 1, tokens, head_dim)`` go
through the cache's own update path as one multi-token update, like a prompt. The bytes that layer
then holds are scaled to the model: everything except positions by ``kv_heads * batch`` (codes,
scales, zero-points, centres, staging, the full-precision window: one row per batch row and kv
head), the positions by ``kv_heads`` for per-head policies (H2O; one row per head, none per batch
row) and not at all for shared ones (one row for every head and batch row), and the tensors a
transform holds (a rotation matrix) once per cache. A shared policy's demoted positions are held
once for all the layers that demote the same ones; a second layer of each composition is fed too,
so that what a later layer adds is measured rather than assumed. The result is what the real
cache's report says after a prefill, byte for byte.

Cost: one update of ``tokens`` tokens, one kv head, batch 1, for one or two layers of each distinct
layer composition: for a 30-layer model with one composition, two layers' worth of quantization.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from kvpolicy.errors import ConfigError
from kvpolicy.memory import SEGMENTS, LayerBytes, MemoryReport, _human

#: the largest prompt :func:`estimate` accepts: its probe holds ``2 * tokens * head_dim`` elements of the
#: dtype per probed layer (256 MiB at head_dim 64 in float32), and a few times that while demoting
MAX_TOKENS = 1 << 20
#: dtypes of the model's keys and values, by torch name
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: transformers layer types left to transformers' own layers that hold keys and values (probed like a
#: compressed layer: their report counts the tokens they keep)
KV_KINDS = ("sliding_attention", "chunked_attention")
#: layer types that hold no keys or values (0 bytes: a linear-attention layer's fixed-size state is not estimated,
#: though ``memory_report`` counts it once a model has filled it)
EMPTY_KINDS = ("dummy", "conv", "linear_attention")


@dataclass(frozen=True)
class Estimate:
    """What a cache will hold after a prompt of :attr:`tokens` tokens (see :func:`estimate`).

    Attributes
    ----------
    tokens : int
        The prompt length.
    batch : int
        Batch rows (all of :attr:`tokens` tokens, no padding).
    dtype : torch.dtype
        The dtype of the model's keys and values.
    kv_heads, head_dim : int
        The model's key/value heads and head dimension.
    report : MemoryReport
        One :class:`~kvpolicy.memory.LayerBytes` per layer of the model: what
        ``cache.memory_report()`` returns after that prefill. Every figure below is the report's.
    """

    tokens: int
    batch: int
    dtype: torch.dtype
    kv_heads: int
    head_dim: int
    report: MemoryReport

    @property
    def total_bytes(self) -> int:
        """Every byte held: data, codes, metadata, staging, positions, what a transform holds."""
        return self.report.total_bytes

    @property
    def baseline_bytes(self) -> int:
        """A 16-bit ``DynamicCache`` of the same model after the same prompt (sliding layers: the tokens
        they keep)."""
        return self.report.baseline_bytes

    @property
    def dynamic_bytes(self) -> int:
        """A ``DynamicCache`` in :attr:`dtype`: :attr:`baseline_bytes` at the dtype's element size."""
        return self.report.baseline_bytes * torch.empty((), dtype=self.dtype).element_size() // 2

    @property
    def segments(self) -> dict[str, int]:
        """Bytes by segment (``full_precision``, ``codes``, ``scales``, ``zeros``, ``staging``, ``positions``
        and any other a part reports, such as ``centre`` or ``transform``)."""
        return self.report.segments

    @property
    def ratio(self) -> float:
        """``baseline_bytes / total_bytes``."""
        return self.report.ratio

    @property
    def bits_per_element(self) -> float:
        """``8 * total_bytes / (tokens * layers * batch * kv_heads * 2 * head_dim)``: 16 for a 16-bit
        ``DynamicCache`` (:attr:`MemoryReport.bits_per_element`)."""
        return self.report.bits_per_element

    @property
    def bits_per_element_16bit(self) -> float:
        """:attr:`bits_per_element` with full-precision tensors counted at 16 bits (the figure to
        compare across dtypes; :attr:`MemoryReport.bits_per_element_16bit`)."""
        return self.report.bits_per_element_16bit

    @property
    def layers(self) -> int:
        """Layers of the model."""
        return len(self.report.layers)

    @property
    def compressed_layers(self) -> list[int]:
        """Indices of the layers kvpolicy compresses (the others stay transformers' own)."""
        return self.report.compressed_layers

    @property
    def compressed_bits_per_element(self) -> float:
        """Bits per element of the compressed layers alone (``nan`` when none is compressed); equal to
        :attr:`bits_per_element` when every layer is compressed."""
        mine = [layer for layer in self.report.layers if layer.kind == "compressed"]
        baseline = sum(layer.baseline_bytes for layer in mine)
        return 16 * sum(layer.total_bytes for layer in mine) / baseline if baseline else math.nan

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        compressed = len(self.compressed_layers)
        lines = [
            f"Estimate: {self.tokens} tokens, batch {self.batch}, {dtype}; {self.layers} layers "
            f"({compressed} compressed), {_count(self.kv_heads, 'kv head')}, head_dim {self.head_dim}",
            f"  bytes held:        {_human(self.total_bytes):>12}  ({self.bits_per_element:.2f} bits per element)",
            f"  16-bit baseline:   {_human(self.baseline_bytes):>12}  (ratio {self.ratio:.2f}x)",
        ]
        if self.dynamic_bytes != self.baseline_bytes:
            lines.append(f"  {dtype} DynamicCache: {_human(self.dynamic_bytes):>10}")
        if self.bits_per_element_16bit != self.bits_per_element:
            lines.append(
                f"  bits per element with full-precision tensors at 16 bits: {self.bits_per_element_16bit:.2f}"
            )
        if 0 < compressed < self.layers:
            lines.append(f"  compressed layers alone: {self.compressed_bits_per_element:.2f} bits per element")
        return "\n".join(lines)


def _count(n: int, what: str) -> str:
    """``"1 kv head"``, ``"3 kv heads"``."""
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


@overload
def estimate(
    config: Any, tokens: int, cache_or_preset: Any, *, batch: int = 1, dtype: torch.dtype | str = torch.bfloat16
) -> Estimate: ...


@overload
def estimate(
    config: Any, tokens: Sequence[int], cache_or_preset: Any, *, batch: int = 1,
    dtype: torch.dtype | str = torch.bfloat16,
) -> list[Estimate]: ...  # fmt: skip


def estimate(
    config: Any, tokens: int | Sequence[int], cache_or_preset: Any, *, batch: int = 1,
    dtype: torch.dtype | str = torch.bfloat16,
) -> Estimate | list[Estimate]:  # fmt: skip
    """The bytes a cache will hold after a prompt of ``tokens`` tokens, without running the model.

    What is estimated is the state after the prefill (one multi-token update of the prompt): what
    ``cache.memory_report()`` reports once ``model(prompt_ids, cache=cache)`` has run. Only the
    prompt length matters: decode tokens (generated one at a time after it) are not modelled.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (``model.config``, or ``AutoConfig.from_pretrained(...)``: no weights are
        needed). Its text config (``get_text_config(decoder=True)``) gives the layers, their types,
        the kv heads and the head dimension.
    tokens : int or sequence of int
        The prompt length, ``1 <= tokens <=`` :data:`MAX_TOKENS`; a sequence gives one result per
        length, in its order.
    cache_or_preset : str, pathlib.Path, mapping, CacheSpec or CompressedCache
        The composition: a preset's name or a preset file's name or path (:meth:`CompressedCache.from_preset`),
        a mapping of
        :class:`~kvpolicy.cache.CompressedCache` keywords (without ``config``), a
        :class:`~kvpolicy.spec.CacheSpec`, or a cache that holds
        no tokens yet (its composition is copied; the cache itself is not touched).
    batch : int, optional
        Batch rows, every one holding all ``tokens`` (a left-padded batch holds one layer per row and is
        not modelled). Default 1.
    dtype : torch.dtype or str, optional
        The dtype of the model's keys and values: ``torch.float32``, ``torch.bfloat16`` (default) or
        ``torch.float16``, or their names. It sets the bytes of the full-precision tensors, and with
        ``meta_dtype="auto"`` those of the quantization metadata.

    Returns
    -------
    Estimate or list of Estimate
        One :class:`Estimate` for an int ``tokens``, a list for a sequence.

    Raises
    ------
    ConfigError
        A bad ``config``, ``tokens``, ``batch``, ``dtype`` or composition (naming the parameter and the
        value), or a layer type the estimate does not model (anything but full, sliding and chunked
        attention, and layers holding no keys).

    Notes
    -----
    The probe runs on CPU, so ``backend="auto"`` resolves as on CPU (``cpu``); the ``torch``,
    ``cpu`` and ``triton`` backends lay out their blocks alike (one row per batch row and kv head),
    so the figures hold on CUDA too. A composition naming a backend that cannot run here cannot be
    probed (name ``backend="torch"`` for ``triton``'s bytes); ``quanto`` pads its codes over a whole
    block, which a one-head probe does not see, so its figures can be off by that padding. Layers
    left to transformers (sliding windows) count as memory_report counts them: full precision, the
    tokens they keep. Layers that hold no keys (linear attention, convolutions, layers sharing
    another's cache) count 0 bytes: their fixed-size states are not estimated (``memory_report`` of a used cache
    counts them). A per-head policy's
    positions are counted once per layer; on a model with one kv head, layers that happen to choose
    the same tokens share them in a real run, which then holds less.

    Examples
    --------
    >>> from transformers import LlamaConfig
    >>> config = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    >>> print(estimate(config, 2048, "kvpolicy-3bit"))  # doctest: +SKIP
    """
    text = _text_config(config)
    lengths = _check_tokens(tokens)
    batch = _check_batch(batch)
    dtype = _check_dtype(dtype)
    kv_heads, head_dim = _shape(text)
    build = _builder(cache_or_preset, config)
    out = [_one(build, text, n, batch, dtype, kv_heads, head_dim) for n in lengths]
    return out if not isinstance(tokens, int) else out[0]


# ---------------------------------------------------------------------- checks
def _text_config(config: Any) -> Any:
    from transformers import PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        raise ConfigError(
            f"estimate: config must be a transformers PretrainedConfig (model.config or AutoConfig.from_pretrained); "
            f"got a {type(config).__name__}: {config!r:.80}"
        )
    return config.get_text_config(decoder=True)


def _check_tokens(tokens: Any) -> list[int]:
    """``tokens`` as a list of lengths, each an int in ``[1, MAX_TOKENS]``."""
    many = not isinstance(tokens, int) and isinstance(tokens, Sequence) and not isinstance(tokens, (str, bytes))
    values = list(tokens) if many else [tokens]
    if many and not values:
        raise ConfigError("estimate: tokens must be a positive integer or a non-empty sequence of them; got tokens=[]")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
            raise ConfigError(
                f"estimate: tokens must be an integer in [1, {MAX_TOKENS}] (or a sequence of them); "
                f"got tokens={value!r}"
            )
    return values


def _check_batch(batch: Any) -> int:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"estimate: batch must be an integer >= 1; got batch={batch!r}")
    return batch


def _check_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ConfigError(
        f"estimate: dtype must be one of torch.{', torch.'.join(DTYPES)} (or their names); got dtype={dtype!r}"
    )


def _shape(text: Any) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` of a text config."""
    from kvpolicy.model_check import head_dim as declared_head_dim

    kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    head_dim = declared_head_dim(text)
    for name, value in (("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"estimate: the config's {name} must be a positive integer; got {name}={value!r} "
                f"({type(text).__name__})"
            )
    value_dim = getattr(text, "v_head_dim", None)
    if value_dim is not None and value_dim != head_dim:
        raise ConfigError(
            f"estimate: keys and values of different head dims (head_dim={head_dim}, v_head_dim={value_dim}) are not "
            "modelled"
        )
    return kv_heads, head_dim


def _builder(cache_or_preset: Any, config: Any) -> Callable[[], Any]:
    """A function returning a fresh cache of the composition, built with ``config=``; checked once here."""
    from kvpolicy.cache import CompressedCache
    from kvpolicy.spec import CacheSpec

    if isinstance(cache_or_preset, (str, os.PathLike)):
        spec = CacheSpec.from_preset(cache_or_preset)  # a file is read once

        def build() -> CompressedCache:
            return CompressedCache.from_spec(spec, config)

    elif isinstance(cache_or_preset, Mapping):
        kwargs = dict(cache_or_preset)
        if "config" in kwargs:
            raise ConfigError(
                "estimate: cache_or_preset must not set 'config' (the config is estimate's first argument); "
                f"got keywords {sorted(kwargs)}"
            )

        def build() -> CompressedCache:
            return CompressedCache(**kwargs, config=config)

    elif isinstance(cache_or_preset, (CompressedCache, CacheSpec)):
        spec = _spec(cache_or_preset)

        def build() -> CompressedCache:
            return CompressedCache.from_spec(spec, config)

    else:
        raise ConfigError(
            "estimate: cache_or_preset must be a preset name, a mapping of CompressedCache keywords, a CacheSpec "
            f"or a CompressedCache; got a {type(cache_or_preset).__name__}: {cache_or_preset!r:.80}"
        )
    build()  # a bad composition is refused now, before any length is probed
    return build


def _spec(given: Any) -> Any:
    """The spec of a fresh cache of ``given``'s composition (a CacheSpec, or an unused CompressedCache)."""
    from kvpolicy.spec import CacheSpec

    if isinstance(given, CacheSpec):
        return given
    from kvpolicy.cache import in_use

    if any(in_use(layer) for layer in given.layers):
        raise ConfigError(
            f"estimate: the CompressedCache given already holds tokens ({given.get_seq_length()} in layer 0); pass an "
            "unused cache, its preset or its keywords (cache.memory_report() tells what a used one holds)"
        )
    return given.spec


# ---------------------------------------------------------------------- the probe
def _one(
    build: Callable[[], Any], text: Any, tokens: int, batch: int, dtype: torch.dtype, kv_heads: int, head_dim: int
) -> Estimate:
    """Probe a fresh cache at ``tokens`` tokens and scale its layers to the model."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    from kvpolicy.cache import CompressedLayer, _layer_memory

    cache = build()
    kinds, kwargs = get_layer_types_and_kwargs(text)
    groups: dict[tuple, list[int]] = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, CompressedLayer):
            key: tuple = ("compressed", cache.layer_bits.get(i))
        elif kinds[i] in KV_KINDS:
            key = (kinds[i], tuple(sorted(kwargs[i].items())))
        elif kinds[i] in EMPTY_KINDS:
            continue
        else:
            raise ConfigError(
                f"estimate: layer {i} of this config is of type {kinds[i]!r}, which the estimate does not model (it "
                f"models compressed layers, {', '.join(KV_KINDS)} and layers holding no keys: {', '.join(EMPTY_KINDS)})"
            )
        groups.setdefault(key, []).append(i)
    per_head = bool(cache.policy.per_head)
    # a second layer of a composition measures what later layers add (shared positions count once); a
    # per-head policy's layers share nothing when the model has several kv heads, so its first layer stands for all
    probed = sorted(i for members in groups.values() for i in members[: 1 if per_head else 2])
    _feed(cache, probed, tokens, head_dim, dtype)
    seen: set[tuple[str, int]] = set()  # storages counted so far, in layer order, as memory_report counts them
    probe = {i: _layer_memory(cache.layers[i], i, seen) for i in probed}
    rows = kv_heads * batch
    size = torch.empty((), dtype=dtype).element_size()
    # layers holding no keys (never probed) hold nothing a KV cache report counts
    layers = [LayerBytes(i, 0, dict.fromkeys(SEGMENTS, 0), 0, size, type(layer).__name__)
              for i, layer in enumerate(cache.layers)]  # fmt: skip
    for members in groups.values():
        first = probe[members[0]]
        later = probe[members[1]] if len(members) > 1 and not per_head else None
        for j, i in enumerate(members):
            source = first if j == 0 or later is None else later
            layers[i] = _scaled(source, i, rows, kv_heads if per_head else 1, keep_once=j == 0)
    return Estimate(tokens, batch, dtype, kv_heads, head_dim, MemoryReport(layers))


def _feed(cache: Any, indices: list[int], tokens: int, head_dim: int, dtype: torch.dtype) -> None:
    """One multi-token update of ``(1, 1, tokens, head_dim)`` random keys and values per layer of ``indices``,
    in order, as a prefill would; a score-based policy is given random attention scores for it, and a store
    whose basis fits itself on the queries (``Transform.needs_queries``) random queries."""
    from kvpolicy.cache import CompressedLayer

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i in indices:
            keys = torch.randn((1, 1, tokens, head_dim), generator=generator).to(dtype)
            values = torch.randn((1, 1, tokens, head_dim), generator=generator).to(dtype)
            out = cache.update(keys, values, i)
            layer = cache.layers[i]
            if isinstance(layer, CompressedLayer) and layer.engine.policy.needs_scores:
                layer.observe_attention(torch.rand((1, out[0].shape[-2]), generator=generator))
            feed_random_queries(layer, keys, generator)
            if isinstance(layer, CompressedLayer):
                # demote the prompt now, as the model's next forward would; left to the next layer's update, the
                # release would first demote it into a copy of the store to set its centres (twice the work)
                layer.memory()
            del out, keys, values


def feed_random_queries(layer: Any, keys: torch.Tensor, generator: torch.Generator) -> None:
    """Give ``layer`` random normal queries shaped like ``keys`` (``(batch, kv_heads, n, head_dim)``, the keys
    just appended) when its basis fits itself on the queries (``Transform.needs_queries``) and waits for
    them: for callers that fill a cache through ``Cache.update`` without running attention (a byte estimate,
    a synthetic benchmark), in place of what kvpolicy's attention wrapper would report. Any other layer is
    left alone, and ``generator`` is not drawn from."""
    from kvpolicy.cache import CompressedLayer

    if isinstance(layer, CompressedLayer) and layer.engine.wants_queries:
        query = torch.randn(keys.shape, generator=generator, dtype=keys.dtype, device=keys.device)
        layer.engine.observe_queries(query, keys)


def _scaled(source: LayerBytes, layer_idx: int, rows: int, position_rows: int, keep_once: bool) -> LayerBytes:
    """``source`` (one kv head, batch 1) as layer ``layer_idx`` of the model: data by ``rows`` (kv heads x batch),
    positions by ``position_rows``; what a transform holds (counted once per cache) only where ``keep_once``."""
    segments = {}
    for name, n in source.segments.items():
        if name == "transform":
            segments[name] = n if keep_once else 0
        elif name == "positions":
            segments[name] = n * position_rows
        else:
            segments[name] = n * rows
    return LayerBytes(
        layer_idx, source.tokens, segments, source.baseline_bytes * rows, source.element_size, source.kind
    )
