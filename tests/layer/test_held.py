"""``HeldTokens``: a layer's held tokens and the moves between segments, with bare tensors (no model,
no transformers)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.actions.evict import Evict
from kvpolicy.actions.none import NoCompression
from kvpolicy.actions.quantize import Quantize
from kvpolicy.actions.tiered import Tiered
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.layer.composition import Composition, Plan
from kvpolicy.layer.held import HeldTokens
from kvpolicy.policies import LogWindow, RecentWindow
from kvpolicy.testing import chunkings
from kvpolicy.transforms import NoTransform

D = 16


def _actions() -> dict[str, object]:
    return {
        "quantize": Quantize(bits=2, group_size=8),
        "evict": Evict(),
        "tiered": Tiered(
            tiers=[Quantize(bits=4, group_size=8, key_axis="token"), Quantize(bits=2, group_size=8)],
            keep=[LogWindow(2)],
        ),
    }


def _segments(policy, action) -> HeldTokens:
    backend = TorchBackend()
    return HeldTokens(Composition(policy, action, backend, NoTransform()), Plan(backend, action), layer_idx=0)


def _tokens(n: int, seed: int, heads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, n, D, generator=g), torch.randn(1, heads, n, D, generator=g)


def _started(policy, action, heads: int = 2) -> HeldTokens:
    seg = _segments(policy, action)
    k, v = _tokens(0, 0, heads)
    seg.start(k, v)
    return seg


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["quantize", "evict", "tiered"]),
    recent=st.booleans(),
    window=st.integers(1, 6),
    data=st.data(),
)
def test_every_token_is_in_one_segment_and_full_precision_tokens_are_exact(kind, recent, window, data):
    """After any sequence of appends: full-precision and demoted positions are disjoint; with a
    keeping action they cover every position seen; the policy's set is exactly the full-precision
    segment; the ordered view returns the full-precision tokens bit for bit at their positions;
    ``moves`` grows exactly when tokens left the full-precision segment."""
    policy = RecentWindow(window) if recent else LogWindow(window)
    action = _actions()[kind]
    plan = data.draw(chunkings(data.draw(st.integers(1, 80)), first_nonzero=True))
    seg = _started(policy, action)
    keys, values = [], []
    for i, n in enumerate(plan):
        k, v = _tokens(n, i)
        keys.append(k)
        values.append(v)
        before = (seg.moves, seg.full_pos.shape[1])  # positions() below settles: nothing is pending here
        seg.append(k, v)
        held = seg.positions()
        full, compressed = held["full"].tolist(), held["compressed"].tolist()
        assert not set(full) & set(compressed)
        assert full == sorted(full)
        assert full == sorted(seg.state.full_positions())
        if kind != "evict":
            assert sorted(full + compressed) == list(range(seg.length))
        else:
            assert compressed == []
        # a move happened iff the full-precision segment shrank below what it was plus the new tokens
        shrank = len(full) < before[1] + n
        assert (seg.moves > before[0]) == shrank
    all_k, all_v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    vk, vv = seg.view("ordered")
    idx = torch.tensor(seg.positions()["full"].tolist(), dtype=torch.long)
    if kind == "evict":
        assert torch.equal(vk, all_k[:, :, idx]) and torch.equal(vv, all_v[:, :, idx])
    else:
        assert vk.shape == all_k.shape
        assert torch.equal(vk[:, :, idx], all_k[:, :, idx]) and torch.equal(vv[:, :, idx], all_v[:, :, idx])


def test_a_multi_token_append_defers_its_demotions_and_a_single_token_one_does_not():
    seg = _started(LogWindow(2), _actions()["quantize"])
    seg.append(*_tokens(20, 0))
    assert seg.pending == 20 and seg.full_pos.shape[1] == 20 and seg.moves == 0
    seg.append(*_tokens(1, 1))  # settles the prefill's demotions, then demotes for the new token
    assert seg.pending == 0 and seg.moves == 2
    assert seg.positions()["full"].tolist() == sorted(seg.state.full_positions())


def test_crop_removes_the_undemoted_tokens_of_the_latest_append_exactly():
    """Cropping the latest append's tokens leaves what a layer that never saw them holds."""
    seg, twin = _started(LogWindow(2), _actions()["quantize"]), _started(LogWindow(2), _actions()["quantize"])
    for s in (seg, twin):
        s.append(*_tokens(30, 0))
        s.append(*_tokens(1, 1))
    seg.append(*_tokens(5, 2))
    assert seg.is_croppable
    seg.crop(3)
    k, v = _tokens(5, 2)
    twin.append(k[:, :, :2], v[:, :, :2])
    for s in (seg, twin):
        s.append(*_tokens(1, 3))
    for a, b in zip(seg.view("ordered"), twin.view("ordered"), strict=True):
        assert torch.equal(a, b)
    assert seg.positions()["full"].tolist() == twin.positions()["full"].tolist()
    with pytest.raises(ValueError, match=r"only the 0 token\(s\) of the latest multi-token update"):
        seg.crop(5)  # more than the single step just taken (which a crop could take back, had it demoted nothing)


def test_saved_segments_restore_into_fresh_ones_and_continue_identically():
    action = _actions()["tiered"]
    seg = _started(LogWindow(2), action)
    seg.append(*_tokens(40, 0))
    for i in range(5):
        seg.append(*_tokens(1, i + 1))
    twin = _started(LogWindow(2), action)
    twin.load_state_dict(seg.state_dict())
    for s in (seg, twin):
        s.append(*_tokens(1, 9))
    for a, b in zip(seg.view("ordered"), twin.view("ordered"), strict=True):
        assert torch.equal(a, b)
    assert seg.memory().segments == twin.memory().segments


def test_saved_parts_that_disagree_are_refused_naming_them():
    seg = _started(LogWindow(2), _actions()["quantize"])
    seg.append(*_tokens(20, 0))
    seg.append(*_tokens(1, 1))
    state = seg.state_dict()
    state["length"] += 1
    with pytest.raises(ValueError, match=r"layer 0: the saved parts disagree: .*demoted tokens for length 22"):
        _started(LogWindow(2), _actions()["quantize"]).load_state_dict(state)


def test_bytes_by_segment_are_the_tensors_held():
    seg = _started(LogWindow(2), _actions()["quantize"])
    seg.append(*_tokens(64, 0))
    seg.append(*_tokens(1, 1))
    report = seg.memory()
    full = seg.keys.numel() * 4 + seg.values.numel() * 4
    assert report.segments["full_precision"] == full
    assert report.segments["positions"] == seg.full_pos.numel() * 4 + seg.store.positions.numel() * 4
    stored = {role: n for role, n in seg.store.nbytes().items() if role != "positions"}
    assert stored and {role: report.segments[role] for role in stored} == stored
    assert report.baseline_bytes == 65 * 2 * (D + D) * 2


def test_without_compression_segments_are_one_growing_tensor():
    seg = _started(LogWindow(2), NoCompression())
    k1, v1 = _tokens(7, 0)
    k2, v2 = _tokens(1, 1)
    seg.append(k1, v1)
    seg.append(k2, v2)
    assert seg.store is None and seg.full_pos is None and seg.moves == 0
    assert torch.equal(seg.view()[0], torch.cat([k1, k2], dim=2))
    assert seg.positions()["full"].tolist() == list(range(8))


def test_the_module_does_not_import_transformers():
    code = "import sys, kvpolicy.layer.held; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
