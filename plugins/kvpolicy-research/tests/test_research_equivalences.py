"""The core's equivalences over the research plugin's transforms: per-row state moves with its row (beam
reorder, batch select: :func:`kvpolicy.testing.check_batch_operations`), a saved cache continues bit for bit
after crops, and state made under inference mode serves the other modes."""

from __future__ import annotations

import copy

import pytest
import torch
from research_cases import tiny_model
from research_parts import one_thread, research_parts  # noqa: F401 - fixtures, and the plugin's parts registered

from kvpolicy import CompressedCache
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.testing import check_batch_operations

pytestmark = pytest.mark.usefixtures("one_thread")

#: name -> (CompressedCache keywords, padded): see kvpolicy.testing.check_batch_operations
BATCH = {
    "query-hadamard": (dict(policy="log", window=4, bits=2, key_scheme="codebook", key_centre=True,
                            transform="query-hadamard"), None),
    "lowrank": (dict(policy="log", window=4, bits=2, key_scheme="codebook", key_centre=True, transform="lowrank",
                     rank=4), None),
    # a left-padded row's forward rounds differently from the row alone, and eigenvectors of near-equal
    # eigenvalues are not continuous in the moments: its rotation may differ (docs/reference/limits.md)
    "calibrated-hadamard": (dict(policy="log", window=4, bits=2, key_scheme="codebook", key_centre=True,
                                 transform="calibrated-hadamard"), False),
    "lowrank-16bit": (dict(policy="recent", window=6, bits=4, group_size=16, transform="lowrank", rank=2,
                           coefficient_bits=16), False),
}  # fmt: skip
Q = {"policy": "log", "group_size": 16, "window": 4, "bits": 4}
SAVED = {
    **{
        f"lowrank-r{r}-c{c}": dict(**Q, transform="lowrank", rank=r, coefficient_bits=c)
        for r in (1, 2, 8)
        for c in (8, 16)
    },
    "query-hadamard": dict(**Q, transform="query-hadamard"),
    "calibrated-hadamard": dict(**Q, transform="calibrated-hadamard"),
    "calibrated-hadamard-keys": dict(**Q, transform="calibrated-hadamard", rotate_values=False),
}
#: (prompt tokens, tokens cropped after it): see the core's tests/test_saved_continues.py
SCENARIOS = [(30, 0), (30, 3), (30, 25), (30, 29), (3, 0), (100, 0), (100, 40)]


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama")
    enable_scores(m)  # the queries a query-weighted basis fits on
    yield m
    disable_scores(m)


@pytest.mark.parametrize("name", list(BATCH))
def test_per_row_state_moves_with_its_row(name):
    kwargs, padded = BATCH[name]
    # the query-weighted and calibrated bases serve no float64 model: checked in float32
    fitted_on_queries = name in ("query-hadamard", "calibrated-hadamard")
    check_batch_operations(kwargs, padded=padded, dtype=torch.float32 if fitted_on_queries else None)


@torch.no_grad()
def _decode(model, cache: CompressedCache, ids: torch.Tensor) -> torch.Tensor:
    out = [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])]
    return torch.cat(out, dim=1) if out else torch.empty(0)


@pytest.mark.parametrize("name", list(SAVED))
def test_a_saved_cache_continues_bit_for_bit_after_any_crop(model, name, tmp_path):
    ids = torch.randint(3, 96, (2, 160), generator=torch.Generator().manual_seed(4))
    for prompt, cropped in SCENARIOS:
        cache = CompressedCache(**SAVED[name])
        with torch.no_grad():
            model(ids[:, :prompt], cache=cache, use_cache=True)
            if cropped:
                cache.crop(-cropped)
        at = prompt - cropped
        for steps in (0, 12):  # at the prompt, and after decode steps (a first fit during decoding)
            _decode(model, cache, ids[:, at : at + steps])
            path = tmp_path / f"{name}-{prompt}-{cropped}-{steps}.kvc"
            cache.save(path, model=model)
            loaded = CompressedCache.load(path, model=model)
            here = at + steps
            want = _decode(model, copy.deepcopy(cache), ids[:, here : here + 16])
            assert torch.equal(_decode(model, loaded, ids[:, here : here + 16]), want), (prompt, cropped, steps)
        del cache


def test_a_crop_before_the_store_holds_anything_forgets_the_fit(model):
    """The prompt's release fitted the basis on the whole prompt; a crop of most of it drops that fit, and the
    demotion of what is left fits again, as if the cropped tokens never came."""
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    cropped, fresh = CompressedCache(**SAVED["lowrank-r2-c8"]), CompressedCache(**SAVED["lowrank-r2-c8"])
    with torch.no_grad():
        model(ids[:, :30], cache=cropped, use_cache=True)
        cropped.crop(-22)
        model(ids[:, :8], cache=fresh, use_cache=True)
    a, b = _decode(model, cropped, ids[:, 8:20]), _decode(model, fresh, ids[:, 8:20])
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)  # keys of a 30- and an 8-token forward: float noise apart
    for la, lb in zip(cropped.layers, fresh.layers, strict=True):
        torch.testing.assert_close(la.engine.held.basis.directions, lb.engine.held.basis.directions, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["lowrank-r2-c8", "lowrank-r1-c16", "query-hadamard", "calibrated-hadamard"])
def test_state_made_in_inference_mode_serves_no_grad_steps(model, name):
    ids = torch.randint(3, 96, (2, 64), generator=torch.Generator().manual_seed(0))
    runs = []
    for prefill in (torch.no_grad, torch.inference_mode):
        cache = CompressedCache(**SAVED[name])
        with prefill():
            model(ids[:, :40], cache=cache, use_cache=True)
        runs.append(_decode(model, cache, ids[:, 40:52]))
    assert torch.equal(runs[0], runs[1])
