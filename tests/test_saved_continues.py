"""A saved cache loads and continues bit for bit, whatever it went through before ``save``.

Across transforms (rotated, none; the research plugin checks its own the same way), centred
codebooks and tiers; before any fit (a prompt shorter than the policy's window), at the fit (the first
demotion) and after it; after ``crop`` of none, a few, most or all but one of a prompt's tokens: ``save``
writes a file ``load`` accepts, and the loaded cache's next logits equal the original's exactly. The held
tensors have standard strides (what a loaded copy has), so the same arithmetic runs on both.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from conftest import tiny_model

from kvpolicy import CompressedCache
from kvpolicy.attention import disable_scores, enable_scores

pytestmark = pytest.mark.usefixtures("one_thread")

Q = {"policy": "log", "group_size": 16}
COMPOSITIONS = {
    "hadamard": dict(**Q, window=4, bits=2, transform="hadamard"),
    "minmax": dict(**Q, window=4, bits=2),
    "kvpolicy-3bit": "kvpolicy-3bit",  # centred codebooks in tiers
}
#: (prompt tokens, tokens cropped after it): a fit at the prompt's release, then crops of none, a few, most and
#: all but one of its tokens; a prompt the window keeps whole (nothing demoted, no fit yet); a long prompt whose
#: release demotes all but the crop window before the crop
SCENARIOS = [(30, 0), (30, 3), (30, 25), (30, 29), (3, 0), (100, 0), (100, 40)]


def _cache(spec) -> CompressedCache:
    return CompressedCache.from_preset(spec) if isinstance(spec, str) else CompressedCache(**spec)


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama")
    enable_scores(m)  # releases each layer's prompt as the forward moves on (and reports queries to a basis)
    yield m
    disable_scores(m)


@torch.no_grad()
def _decode(model, cache: CompressedCache, ids: torch.Tensor) -> torch.Tensor:
    """The logits of feeding ``ids`` ``(batch, n)`` one token at a time (``(batch, n, vocab)``; empty for n = 0)."""
    out = [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])]
    return torch.cat(out, dim=1) if out else torch.empty(0)


def _canonical(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _odd_strides(obj, path: str, seen: set[int]) -> list[str]:
    """Held contiguous tensors (with elements) whose strides are not those of a fresh tensor of their shape (a size-1
    dimension with another stride: torch calls them contiguous, but kernels may take another path for them)."""
    if isinstance(obj, torch.Tensor):
        odd = obj.numel() > 0 and obj.is_contiguous() and obj.stride() != _canonical(obj.shape)
        return [f"{path} {tuple(obj.shape)} {obj.stride()}"] if odd else []
    skip = (str, int, float, bool, type, types.ModuleType, torch.nn.Module, torch.dtype, torch.device)
    if obj is None or isinstance(obj, skip) or id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        return [x for i, item in enumerate(obj) for x in _odd_strides(item, f"{path}[{i}]", seen)]
    if isinstance(obj, dict):
        return [x for key, item in obj.items() for x in _odd_strides(item, f"{path}[{key!r}]", seen)]
    if hasattr(obj, "__dict__"):
        return [x for key, item in vars(obj).items() for x in _odd_strides(item, f"{path}.{key}", seen)]
    return []


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_a_saved_cache_continues_bit_for_bit_after_any_crop(model, name, tmp_path):
    ids = torch.randint(3, 96, (2, 160), generator=torch.Generator().manual_seed(4))
    for prompt, cropped in SCENARIOS:
        cache = _cache(COMPOSITIONS[name])
        with torch.no_grad():
            model(ids[:, :prompt], cache=cache, use_cache=True)
            if cropped:
                cache.crop(-cropped)
        length = prompt - cropped
        for steps in (0, 12):  # at the prompt, and after decode steps (a first fit during decoding)
            _decode(model, cache, ids[:, length : length + steps])
            at = length + steps
            path = tmp_path / f"{name}-{prompt}-{cropped}-{steps}.kvc"
            cache.save(path, model=model)
            loaded = CompressedCache.load(path, model=model)
            assert loaded.get_seq_length() == at
            held = [i for i, layer in enumerate(cache.layers) if _odd_strides(layer.engine, "engine", set())]
            assert held == [], [_odd_strides(cache.layers[i].engine, "engine", set()) for i in held]
            want = _decode(model, copy.deepcopy(cache), ids[:, at : at + 16])
            got = _decode(model, loaded, ids[:, at : at + 16])
            assert torch.equal(got, want), (prompt, cropped, steps, (got - want).abs().max())


@pytest.mark.parametrize("name", ["kvpolicy-3bit"])
def test_a_crop_before_the_store_holds_anything_forgets_the_fit_and_centres_it_took(model, name):
    """The prompt's release gave the empty store a fit (or first-block centres) taken from the whole prompt; a crop
    of most of it drops them, and the demotion of what is left fits again, as if the cropped tokens never came."""
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    cropped, fresh = _cache(COMPOSITIONS[name]), _cache(COMPOSITIONS[name])
    with torch.no_grad():
        model(ids[:, :30], cache=cropped, use_cache=True)
        cropped.crop(-22)
        model(ids[:, :8], cache=fresh, use_cache=True)
        for t in range(8, 20):
            for cache in (cropped, fresh):
                model(ids[:, t : t + 1], cache=cache, use_cache=True)
    checked = 0
    for a, b in zip(cropped.layers, fresh.layers, strict=True):
        held_a, held_b = _fitted(a.engine), _fitted(b.engine)
        assert held_a.keys() == held_b.keys()
        for key, value in held_b.items():  # keys computed in a 30- and an 8-token forward: float noise apart
            torch.testing.assert_close(held_a[key], value, rtol=0, atol=1e-5)
            checked += 1
    assert checked
    for key, value in cropped.positions(0).items():
        assert torch.equal(value, fresh.positions(0)[key]), key


def _fitted(engine) -> dict[str, torch.Tensor]:
    """What a layer took from its first block: a low-rank basis and centre, and each centred stream's centre."""
    basis, store = engine.held.basis, engine.held.store
    out = {name: getattr(basis, name) for name in ("directions", "centre") if getattr(basis, name, None) is not None}
    stores = store._stores() if hasattr(store, "_stores") else [store]  # one per tier
    for i, stream in enumerate(s for st in stores for s in (st.k, st.v)):
        if stream.centre and stream.stream_centre is not None:
            out[f"stream {i}"] = stream.stream_centre
    return out
