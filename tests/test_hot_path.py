"""What a decode step reads again instead of rebuilding: the ``cpu`` backend checks a block once and refuses
a block whose tensors were replaced by something it does not read; a store gives the parts it built until
what they are built from is replaced (a demotion, a batch move), and never stale ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpolicy.actions.quantize import Quantize
from kvpolicy.actions.tiered import Tiered
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError
from kvpolicy.fused import attend_parts
from kvpolicy.layer.parts import Part
from kvpolicy.policies.log import LogWindow

pytestmark = pytest.mark.usefixtures("cpu_kernel")


def _cpu():
    from kvpolicy.backends.cpu_backend import CpuBackend

    return CpuBackend()


def _blocks(be, scheme: str):
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(1, 2, 128, 64, generator=gen), torch.randn(1, 2, 128, 64, generator=gen)
    if scheme == "codebook":
        return (be.quantize(keys, 3, None, "token", scheme="codebook"),
                be.quantize(values, 2, None, "token", scheme="codebook"))  # fmt: skip
    return be.quantize(keys, 2, 32, "channel"), be.quantize(values, 2, 32, "token")


@pytest.mark.parametrize("scheme", ["minmax", "codebook"])
def test_a_block_is_checked_at_its_first_read_only(monkeypatch, scheme):
    be = _cpu()
    keys, values = _blocks(be, scheme)
    query = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(4))
    first = be.attend(query, keys, values, 0.125)
    checked = []
    real = type(be)._kernel_args
    monkeypatch.setattr(type(be), "_kernel_args", lambda self, q, role: checked.append(role) or real(self, q, role))
    again = be.attend(query, keys, values, 0.125)
    assert checked == []
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    # a fresh block (a narrowed view) is checked at its first read, and read back after
    narrowed = keys.narrow(0, 64), values.narrow(0, 64)
    be.attend(query, *narrowed, 0.125)
    be.attend(query, *narrowed, 0.125)
    assert checked == ["key", "value"]


def test_a_block_whose_codes_were_replaced_is_checked_again_and_refused():
    be = _cpu()
    keys, values = _blocks(be, "codebook")
    query = torch.randn(1, 2, 1, 64)
    be.attend(query, keys, values, 0.125)
    values.codes = values.codes[..., :8]  # not what a 2-bit block of head dim 64 holds
    with pytest.raises(ConfigError, match="need uint8 codes"):
        be.attend(query, keys, values, 0.125)
    keys.scales = keys.scales.double()
    with pytest.raises(ConfigError, match="scale per token"):
        be.attend(query, keys, dataclasses.replace(values, codes=values.codes), 0.125)


def test_a_query_on_a_dtype_the_backend_does_not_take_is_refused_after_good_ones():
    be = _cpu()
    keys, values = _blocks(be, "minmax")
    be.attend(torch.randn(1, 2, 1, 64), keys, values, 0.125)
    with pytest.raises(ConfigError, match="float64"):
        be.attend(torch.randn(1, 2, 1, 64, dtype=torch.float64), keys, values, 0.125)


def _parts_attention(store, query):
    return attend_parts(query, [*store.parts(), Part(query[:, :, :0], query[:, :, :0])], 0.125)


@pytest.mark.parametrize("kind", ["quantize", "tiered"])
def test_a_store_gives_its_parts_again_until_they_change(kind):
    action = Quantize(bits=2, group_size=32)
    if kind == "tiered":
        action = Tiered(keep=[LogWindow(8)], tiers=[Quantize(bits=4, group_size=32, key_axis="token"), action])
    store = action.new_store(TorchBackend(), 0)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(1, 2, 1, 64, generator=gen)
    seen = 0
    for n in (40, 1, 1, 30, 1):
        store.add(torch.randn(1, 2, n, 64, generator=gen), torch.randn(1, 2, n, 64, generator=gen),
                  torch.arange(seen, seen + n, dtype=torch.int32)[None])  # fmt: skip
        seen += n
        first, again = store.parts(), store.parts()
        assert first is not again and all(a is b for a, b in zip(first, again, strict=True))
        assert sum(p.keys.shape[2] for p in first) == seen
        want = attend_parts(query, [Part(store.keys(), store.values()), Part(query[:, :, :0], query[:, :, :0])], 0.125)
        torch.testing.assert_close(_parts_attention(store, query), want, rtol=1e-5, atol=1e-5)
        positions = store.positions
        assert torch.equal(torch.cat([p.positions for p in first], dim=1).sort().values, positions.sort().values)
    # a batch move replaces the blocks: the parts follow
    store.map_batch(lambda t: torch.cat([t, t]))
    assert all(p.keys.shape[0] == 2 for p in store.parts())
