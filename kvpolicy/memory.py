"""Byte accounting of what a cache really holds."""

from __future__ import annotations

from dataclasses import dataclass, field

#: order in which segments are printed
SEGMENTS = ("full_precision", "codes", "scales", "zeros", "staging", "positions")


@dataclass(frozen=True)
class LayerBytes:
    """Bytes held by one layer, by segment, and the 16-bit baseline for the same tokens.

    Attributes
    ----------
    layer_idx : int
        Layer index.
    tokens : int
        Logical length (tokens seen) of the layer.
    segments : dict of str to int
        Bytes by segment: ``full_precision`` (uncompressed keys and values), ``codes`` (packed
        quantized codes), ``scales`` and ``zeros`` (per-group metadata), ``staging``
        (full-precision keys/values waiting for a complete per-channel group), ``positions``
        (index tensors), ``scale_base`` (with one-byte scales of scaled table codes: the origin of
        their logarithmic grid, one int16 per batch row and head) and ``transform`` (what a
        transform holds: a rotation matrix, per-channel weights, a fitted basis).
    baseline_bytes : int
        A 16-bit cache holding the same tokens: ``tokens * batch * kv_heads * head_dim * 2 * 2``.
    element_size : int
        Bytes per element of the layer's full-precision tensors (``full_precision`` and
        ``staging``): 4 for a float32 model, 2 for float16/bfloat16.
    kind : str
        ``"compressed"`` for a kvpolicy layer, else the class of the transformers layer left
        uncompressed (``"DynamicSlidingWindowLayer"`` for a hybrid model's sliding layers).
    """

    layer_idx: int
    tokens: int
    segments: dict[str, int]
    baseline_bytes: int
    element_size: int = 2
    kind: str = "compressed"

    @property
    def total_bytes(self) -> int:
        return sum(self.segments.values())

    @property
    def total_bytes_16bit(self) -> int:
        """:attr:`total_bytes` with the full-precision tensors counted at 16 bits per element (what
        they would hold in a 16-bit model; codes, metadata and positions as held)."""
        wide = self.segments.get("full_precision", 0) + self.segments.get("staging", 0)
        if self.element_size <= 2:
            return self.total_bytes
        return self.total_bytes - wide + wide * 2 // self.element_size


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by a whole cache, computed from the tensors it actually holds.

    Attributes
    ----------
    layers : list of LayerBytes
        One entry per compressed layer.
    """

    layers: list[LayerBytes] = field(default_factory=list)

    @property
    def segments(self) -> dict[str, int]:
        """Bytes by segment, summed over layers."""
        out = dict.fromkeys(SEGMENTS, 0)
        for layer in self.layers:
            for name, n in layer.segments.items():
                out[name] = out.get(name, 0) + n
        return out

    @property
    def compressed_layers(self) -> list[int]:
        """Indices of the layers kvpolicy compresses (the others are transformers' own layers)."""
        return [layer.layer_idx for layer in self.layers if layer.kind == "compressed"]

    @property
    def total_bytes(self) -> int:
        """Everything the cache holds (data, codes, metadata, staging, position indices)."""
        return sum(layer.total_bytes for layer in self.layers)

    @property
    def baseline_bytes(self) -> int:
        """A 16-bit cache holding the same tokens."""
        return sum(layer.baseline_bytes for layer in self.layers)

    @property
    def ratio(self) -> float:
        """``baseline_bytes / total_bytes`` (``inf`` for an empty cache)."""
        total = self.total_bytes
        return float("inf") if total == 0 else self.baseline_bytes / total

    @property
    def total_bytes_16bit(self) -> int:
        """:attr:`total_bytes` with full-precision tensors (the window and the staging) counted at 16
        bits per element: for models run in float32, what the same cache holds in a 16-bit model."""
        return sum(layer.total_bytes_16bit for layer in self.layers)

    @property
    def bits_per_element(self) -> float:
        """``8 * total_bytes / (tokens * layers * batch * kv_heads * (key dim + value dim))``: every
        byte held (codes, scales, zero-points, positions, staging, the full-precision window) per
        cached element; 16 for a 16-bit ``DynamicCache``. ``nan`` for an empty cache."""
        return 16 * self.total_bytes / self.baseline_bytes if self.baseline_bytes else float("nan")

    @property
    def bits_per_element_16bit(self) -> float:
        """:attr:`bits_per_element` with the full-precision tensors counted at 16 bits (see
        :attr:`total_bytes_16bit`): the figure to compare across model dtypes."""
        return 16 * self.total_bytes_16bit / self.baseline_bytes if self.baseline_bytes else float("nan")

    def __str__(self) -> str:
        total = self.total_bytes
        tokens = max((layer.tokens for layer in self.layers), default=0)
        lines = [f"MemoryReport: {len(self.layers)} layers, {tokens} tokens"]
        others = [layer for layer in self.layers if layer.kind != "compressed"]
        if others:
            kinds = ", ".join(sorted({layer.kind for layer in others}))
            lines.append(
                f"  compressed layers: {self.compressed_layers}; {len(others)} left to transformers ({kinds}), "
                "counted as held"
            )
        lines.append(f"  {'segment':<16}{'bytes':>14}{'share':>9}")
        for name, n in self.segments.items():
            share = n / total if total else 0.0
            lines.append(f"  {name:<16}{_human(n):>14}{share:>9.1%}")
        lines.append(f"  {'total':<16}{_human(total):>14}")
        lines.append(f"  {'16-bit baseline':<16}{_human(self.baseline_bytes):>14}")
        lines.append(f"  ratio (baseline / total): {self.ratio:.2f}x")
        bits = f"  bits per element: {self.bits_per_element:.2f}"
        if self.total_bytes_16bit != self.total_bytes:
            bits += f" ({self.bits_per_element_16bit:.2f} with full-precision tensors at 16 bits)"
        lines.append(bits)
        return "\n".join(lines)


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
