"""Compact position storage: int32, and a shared policy's demoted positions held once per cache."""

from __future__ import annotations

import gc

import pytest
import torch

from kvpolicy import CompressedCache
from kvpolicy.errors import ConfigError
from kvpolicy.positions import POSITION_DTYPE, PositionBook, check_length, storage_bytes


def _fill(cache: CompressedCache, layers: int, prompt: int, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for n in (prompt,) + (1,) * steps:
        for layer in range(layers):
            cache.update(torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g), layer)


def test_positions_are_held_as_int32_and_reported_as_int64():
    cache = CompressedCache(policy="log", window=4, action="quantize", bits=2, group_size=8)
    _fill(cache, layers=1, prompt=40, steps=3)
    layer = cache.layers[0]
    assert layer.engine.held.full_pos.dtype == layer.engine.held.store.positions.dtype == POSITION_DTYPE == torch.int32
    pos = cache.positions(0)
    assert all(t.dtype == torch.int64 for t in pos.values())
    assert sorted(pos["full"].tolist() + pos["compressed"].tolist()) == list(range(43))


@pytest.mark.parametrize(
    ("policy", "kwargs"), [("log", {"window": 4}), ("recent", {"window": 8}), ("sink", {"sinks": 2, "window": 6})]
)
def test_shared_policy_positions_are_held_once_for_all_layers(policy, kwargs):
    layers = 5
    cache = CompressedCache(policy=policy, action="quantize", bits=2, group_size=8, **kwargs)
    _fill(cache, layers=layers, prompt=50, steps=20)
    stores = [layer.engine.held.store.positions for layer in cache.layers]
    ptrs = {p.untyped_storage().data_ptr() for p in stores}
    assert len(ptrs) == 1  # one storage
    demoted = stores[0].shape[1]
    assert demoted > 0 and all(torch.equal(p, stores[0]) for p in stores)
    report = cache.memory_report()
    full = sum(layer.engine.held.full_pos.numel() for layer in cache.layers) * 4
    assert report.segments["positions"] == full + demoted * 4
    # each layer alone still owns what it holds
    assert (
        cache.layers[3].memory().segments["positions"] == cache.layers[3].engine.held.full_pos.numel() * 4 + demoted * 4
    )


def test_shared_positions_survive_other_layers_changing():
    """A layer's positions stay correct while other layers demote, reset or hold other positions."""
    cache = CompressedCache(policy="log", window=4, action="quantize", bits=2, group_size=8)
    _fill(cache, layers=3, prompt=30, steps=0)
    reference = CompressedCache(policy="log", window=4, action="quantize", bits=2, group_size=8)
    _fill(reference, layers=1, prompt=30, steps=0)
    g = torch.Generator().manual_seed(1)
    for step in range(25):  # layer 0 runs ahead of layers 1-2 by one step
        for layer in range(3) if step else (0,):
            cache.update(torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g), layer)
        if step:
            reference.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0)
    cache.layers[0].reset()
    gc.collect()
    for layer in (1, 2):
        assert torch.equal(cache.positions(layer)["compressed"], reference.positions(0)["compressed"])


def test_per_head_policy_positions_are_per_layer():
    """H2O selects per head from each layer's own scores: nothing is shared."""
    cache = CompressedCache(policy="h2o", heavy=4, recent=4, action="quantize", bits=2, group_size=8)
    g = torch.Generator().manual_seed(0)
    for n in (24, 1, 1):
        for layer_idx in range(2):
            cache.update(torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g), layer_idx)
            layer = cache.layers[layer_idx]
            keys = layer.engine.length
            layer.observe_attention(torch.rand(2, keys, generator=g))
    a, b = (layer.engine.held.store.positions for layer in cache.layers)
    assert a.shape[0] == 2 and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    report = cache.memory_report()
    expected = sum(
        (layer.engine.held.full_pos.numel() + layer.engine.held.store.positions.numel()) * 4 for layer in cache.layers
    )
    assert report.segments["positions"] == expected


def test_position_book_shares_prefixes_and_keeps_diverging_sequences_apart():
    book = PositionBook()
    a = torch.tensor([[1, 3, 5, 7]], dtype=torch.int32)
    assert book.intern(a) is a
    shorter = book.intern(torch.tensor([[1, 3]], dtype=torch.int32))
    assert shorter.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert shorter.tolist() == [[1, 3]]
    other = torch.tensor([[2, 3]], dtype=torch.int32)
    assert book.intern(other) is other  # differs: kept apart
    longer = torch.tensor([[1, 3, 5, 7, 9]], dtype=torch.int32)
    assert book.intern(longer) is longer and book.held is longer  # extends: becomes the shared one
    diverged = torch.tensor([[1, 3, 5, 8, 9, 11]], dtype=torch.int32)
    assert book.intern(diverged) is diverged and book.held is longer
    assert book.intern(torch.tensor([[1, 3, 5, 7]], dtype=torch.int64)).dtype == torch.int64  # another dtype


def test_position_book_keeps_nothing_alive():
    book = PositionBook()
    book.intern(torch.arange(10, dtype=torch.int32)[None])
    gc.collect()
    assert book.held is None


def test_storage_bytes_counts_a_storage_once_and_whole():
    base = torch.arange(100, dtype=torch.int32)[None]
    seen: set = set()
    assert storage_bytes(base[:, :10], seen) == 400
    assert storage_bytes(base, seen) == 0
    assert storage_bytes(base[:, :10]) == 400


def test_lengths_beyond_int32_are_refused():
    check_length(2**31 - 1)
    with pytest.raises(ConfigError, match="2147483648 tokens"):
        check_length(2**31)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_shared_positions_correct(how):
    import copy
    import pickle

    cache = CompressedCache(policy="log", window=4, action="quantize", bits=2, group_size=8)
    _fill(cache, layers=3, prompt=40, steps=5)
    twin = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
    for c in (cache, twin):
        _fill(c, layers=3, prompt=1, steps=30, seed=3)
    for layer in range(3):
        assert torch.equal(twin.positions(layer)["compressed"], cache.positions(layer)["compressed"])
    assert twin.memory_report().total_bytes == cache.memory_report().total_bytes
