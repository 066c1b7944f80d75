"""A transformers cache's keys and values as LMCache chunks, and back.

LMCache moves a prompt's KV in chunks of ``chunk_size`` tokens (256 by default), each shaped
``[2, layers, tokens, kv_heads × head_dim]`` (keys and values stacked, every layer); the last chunk of a
prompt may be shorter. :func:`to_chunks` cuts a filled ``DynamicCache`` (batch size 1) into such chunks,
:func:`from_chunks` builds a ``DynamicCache`` that continues decoding from them. This is what an inference
engine's LMCache connector does with its paged cache; here it lets a transformers model store and reuse
a prompt's KV through LMCache (and the codec's tests and measurements use it).
"""

from __future__ import annotations

from typing import Any

import torch

#: LMCache's default chunk size, in tokens
CHUNK_SIZE = 256


def to_chunks(cache: Any, chunk_size: int = CHUNK_SIZE) -> list[torch.Tensor]:
    """The chunks of a filled cache's tokens, in order.

    Parameters
    ----------
    cache : transformers.Cache
        A cache whose layers hold ``keys`` and ``values`` of shape ``(1, kv_heads, tokens, head_dim)``, the
        same in every layer (a ``DynamicCache`` of a model without sliding-window layers).
    chunk_size : int
        Tokens per chunk (the last may hold fewer).

    Returns
    -------
    list of torch.Tensor
        ``[2, layers, tokens, kv_heads × head_dim]`` each, in the cache's dtype.

    Raises
    ------
    ValueError
        A batch of more than one row, layers of different shapes, or a chunk size below 1.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"to_chunks: chunk_size must be an integer >= 1; got chunk_size={chunk_size!r}")
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    shapes = {tuple(t.shape) for t in keys + values}
    if len(shapes) != 1:
        raise ValueError(f"to_chunks: every layer's keys and values must have one shape; got {sorted(shapes)}")
    batch, heads, tokens, head_dim = next(iter(shapes))
    if batch != 1:
        raise ValueError(f"to_chunks: LMCache chunks hold one sequence; the cache holds a batch of {batch}")

    def rows(t: torch.Tensor, start: int, end: int) -> torch.Tensor:  # (heads, n, dim) -> (n, heads * dim)
        return t[0, :, start:end].transpose(0, 1).reshape(end - start, heads * head_dim)

    return [
        torch.stack([torch.stack([rows(t, s, min(s + chunk_size, tokens)) for t in role]) for role in (keys, values)])
        for s in range(0, tokens, chunk_size)
    ]


def from_chunks(chunks: list[torch.Tensor], head_dim: int, config: Any = None) -> Any:
    """A ``DynamicCache`` holding the tokens of ``chunks`` (as :func:`to_chunks` cut them), ready to decode on.

    Parameters
    ----------
    chunks : list of torch.Tensor
        ``[2, layers, tokens, kv_heads × head_dim]`` each, in order.
    head_dim : int
        The model's head dim.
    config : transformers.PretrainedConfig, optional
        The model's config, handed to ``DynamicCache``.

    Raises
    ------
    ValueError
        No chunks, chunks of different layers, hidden sizes or dtypes, or a hidden size that ``head_dim``
        does not divide.
    """
    from transformers import DynamicCache

    if not chunks:
        raise ValueError("from_chunks: give at least one chunk")
    kinds = {(c.dim(), c.shape[0], c.shape[1], c.shape[-1], c.dtype) for c in chunks}
    if len(kinds) != 1:
        raise ValueError(f"from_chunks: chunks of different layouts {sorted(map(str, kinds))}")
    dim, two, layers, hidden, _ = next(iter(kinds))
    if dim != 4 or two != 2 or hidden % head_dim:
        raise ValueError(
            f"from_chunks: chunks must be [2, layers, tokens, kv_heads × head_dim] with head_dim={head_dim}; got "
            f"{list(chunks[0].shape)}"
        )
    whole = torch.cat(list(chunks), dim=2)  # (2, layers, tokens, hidden)
    tokens = whole.shape[2]
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for layer in range(layers):
        k, v = (
            whole[role, layer].reshape(tokens, hidden // head_dim, head_dim).transpose(0, 1)[None] for role in (0, 1)
        )
        cache.update(k.contiguous(), v.contiguous(), layer)
    return cache
