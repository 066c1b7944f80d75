"""Per-layer precision: ``CompressedCache(..., layer_bits={0: 4, -1: (4, 2)})``.

Some layers lose more to quantization than others; the first and last ones most often (vLLM keeps
two of each at higher precision by default). ``layer_bits`` maps layer indices to the code widths
of that layer: an int (keys and values alike) or a ``(key_bits, value_bits)`` pair. Every other
setting of the cache's ``Quantize`` action (scheme, group sizes, axes, metadata dtype) applies to
every layer. :func:`boundary` builds the common map. Knows nothing about transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpolicy.actions.base import Action
from kvpolicy.errors import ConfigError

#: one layer's widths as given: ``bits`` or ``(key_bits, value_bits)``
Widths = int | tuple[int, int]


def boundary(first: int = 2, last: int = 2, bits: Widths = 4) -> dict[int, Widths]:
    """``layer_bits`` that hold the first ``first`` and the last ``last`` layers at ``bits``.

    The last layers are negative indices, resolved against the model's layer count, so the cache
    needs ``config=model.config``.

    Examples
    --------
    >>> boundary(2, 2, 4)
    {0: 4, 1: 4, -2: 4, -1: 4}
    """
    for name, value in (("first", first), ("last", last)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"boundary: {name} must be an integer >= 0; got {name}={value!r}")
    return {**dict.fromkeys(range(first), bits), **dict.fromkeys(range(-last, 0), bits)}


def normalize(layer_bits: Mapping[Any, Any]) -> dict[int, tuple[int, int]]:
    """``{layer index: (key_bits, value_bits)}`` from what a user (or a TOML file: string keys) wrote.

    Raises
    ------
    ConfigError
        Keys that are not integers, widths that are not an int or a pair of ints.
    """
    if not isinstance(layer_bits, Mapping):
        raise ConfigError(
            f"layer_bits must map layer indices to bits or (key_bits, value_bits); got layer_bits={layer_bits!r}"
        )
    out: dict[int, tuple[int, int]] = {}
    for key, value in layer_bits.items():
        index = _index(key)
        if isinstance(value, bool):
            value = None
        if isinstance(value, int):
            pair = (value, value)
        elif isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(v) for v in value):
            pair = (int(value[0]), int(value[1]))
        else:
            raise ConfigError(
                f"layer_bits[{key!r}] must be bits (an int) or (key_bits, value_bits); got {layer_bits[key]!r}"
            )
        if index in out and out[index] != pair:
            raise ConfigError(f"layer_bits names layer {index} twice, with {out[index]} and {pair}")
        out[index] = pair
    return out


def resolve(widths: dict[int, tuple[int, int]], num_layers: int | None) -> dict[int, tuple[int, int]]:
    """Negative indices counted from the end; every index checked against ``num_layers`` (when known).

    Raises
    ------
    ConfigError
        A negative index without a layer count, an index the model lacks, or two keys naming one
        layer with different widths.
    """
    out: dict[int, tuple[int, int]] = {}
    for index, pair in widths.items():
        if index < 0:
            if num_layers is None:
                raise ConfigError(
                    f"layer_bits: negative layer index {index} counts from the end, which needs the model's layer "
                    "count: pass config=model.config"
                )
            resolved = num_layers + index
        else:
            resolved = index
        if num_layers is not None and not 0 <= resolved < num_layers:
            raise ConfigError(
                f"layer_bits names layer {index}, but the model has {num_layers} layers (indices 0..{num_layers - 1} "
                f"or -{num_layers}..-1)"
            )
        if resolved in out and out[resolved] != pair:
            raise ConfigError(f"layer_bits names layer {resolved} twice, with {out[resolved]} and {pair}")
        out[resolved] = pair
    return out


def layer_actions(action: Action, widths: dict[int, tuple[int, int]]) -> dict[int, Action]:
    """The action of each listed layer: ``action`` with that layer's key and value widths.

    Raises
    ------
    ConfigError
        If ``action`` has no code widths (``"evict"``, ``"none"``).
    """
    if not widths:
        return {}
    return {index: action.with_widths(kb, vb) for index, (kb, vb) in sorted(widths.items())}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _index(key: object) -> int:
    if _is_int(key):
        return int(key)  # type: ignore[arg-type]
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            pass
    raise ConfigError(f"layer_bits keys must be layer indices (ints; negative counts from the end); got {key!r}")
