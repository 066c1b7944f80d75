"""Chunked prefill (kvpolicy.prefill.chunked_prefill and generate's prefill_chunk_size) equals unchunked."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import kvpolicy.layer.held as held_tokens
from kvpolicy import CompressedCache
from kvpolicy.cache import CompressedLayer
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy.prefill import chunked_prefill

PROMPT = 300


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", layers=3)
    enable_fused(m)
    yield m
    disable_fused(m)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _decode(model, cache, ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])], 1)


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, PROMPT, 10 * PROMPT])
def test_without_compression_chunked_logits_equal_unchunked(model, chunk):
    ids = _ids(PROMPT + 5)
    whole, parts = CompressedCache(action="none"), CompressedCache(action="none")
    with torch.inference_mode():
        ref = model(ids[:, :PROMPT], cache=whole, use_cache=True).logits[:, -1:]
    got = chunked_prefill(model, ids[:, :PROMPT], parts, chunk).logits[:, -1:]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(_decode(model, parts, ids[:, PROMPT:]), _decode(model, whole, ids[:, PROMPT:]),
                               rtol=0, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(policy="log", action="quantize", bits=2),
        dict(policy="sink", sinks=4, window=40, action="evict"),
        dict(policy="log", window=8, action="quantize", bits=4, group_size=32, transform="hadamard"),
    ],
)
def test_chunked_prefill_makes_the_demotions_of_an_unchunked_one(model, kwargs):
    ids = _ids(PROMPT + 4, seed=1)
    whole, parts = CompressedCache(**kwargs), CompressedCache(**kwargs)
    with torch.inference_mode():
        model(ids[:, :PROMPT], cache=whole, use_cache=True)
    chunked_prefill(model, ids[:, :PROMPT], parts, 64)
    _decode(model, whole, ids[:, PROMPT:])
    _decode(model, parts, ids[:, PROMPT:])
    for i in range(3):
        for key, value in whole.positions(i).items():
            assert torch.equal(value, parts.positions(i)[key]), (i, key)
    assert whole.memory_report().total_bytes == parts.memory_report().total_bytes


def test_a_chunked_prefill_holds_one_chunk_at_full_precision_at_a_time(model, monkeypatch):
    """After each chunk, every layer the model has moved past holds its policy's set, the crop window
    and nothing more of the prompt at full precision."""
    cache = CompressedCache(policy="log", action="quantize", bits=2)
    seen: list[tuple[int, int]] = []
    original = CompressedLayer.update

    def spy(self, key_states, value_states, *args, **kwargs):
        out = original(self, key_states, value_states, *args, **kwargs)
        seen.append((self.layer_idx, self.engine.held.keys.shape[2]))
        return out

    monkeypatch.setattr(CompressedLayer, "update", spy)
    chunked_prefill(model, _ids(PROMPT), cache, 50)
    bound = 3 * 42 + held_tokens.CROP_WINDOW + 50  # |FP| <= 3W, the crop window, the new chunk
    assert len(seen) == 3 * 6 and max(n for _, n in seen) <= bound
    assert max(n for _, n in seen) < PROMPT


def test_generate_with_prefill_chunk_size_generates_what_an_unchunked_prompt_does(model):
    ids = _ids(PROMPT, seed=2)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    whole = model.generate(ids, cache=CompressedCache(action="none"), **kw)
    parts = model.generate(ids, cache=CompressedCache(action="none"), prefill_chunk_size=64, **kw)
    assert torch.equal(whole, parts)
    cache = CompressedCache(policy="log", action="quantize", bits=2)
    model.generate(ids, cache=cache, prefill_chunk_size=64, **kw)
    ref = CompressedCache(policy="log", action="quantize", bits=2)
    model.generate(ids, cache=ref, **kw)
    for key, value in ref.positions(0).items():
        assert torch.equal(value, cache.positions(0)[key])


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64", None])
def test_bad_chunk_sizes_are_clear_errors(model, bad):
    with pytest.raises(ValueError, match=rf"chunk_size must be an integer >= 1 .*got chunk_size={bad!r}"):
        chunked_prefill(model, _ids(10), CompressedCache(action="none"), bad)


def test_an_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, n\) with n >= 1; got shape \(1, 0\)"):
        chunked_prefill(model, _ids(10)[:, :0], CompressedCache(action="none"), 4)


def test_only_the_last_positions_logits_are_kept_unless_asked(model):
    """As generate does (logits_to_keep=1): a chunk of C tokens holds one position's logits, not C; 0 keeps all."""
    ids = _ids(40, seed=5)
    last = chunked_prefill(model, ids, CompressedCache(action="none"), 16)
    every = chunked_prefill(model, ids, CompressedCache(action="none"), 16, logits_to_keep=0)
    assert last.logits.shape == (1, 1, 96) and every.logits.shape == (1, 8, 96)  # the last chunk: 40 - 32 tokens
    with torch.inference_mode():
        whole = model(ids, cache=CompressedCache(action="none"), use_cache=True).logits
    torch.testing.assert_close(every.logits, whole[:, 32:], rtol=0, atol=1e-5)
    torch.testing.assert_close(last.logits, whole[:, -1:], rtol=0, atol=1e-5)


def test_a_model_that_takes_no_logits_to_keep_is_not_given_it():
    seen: list[dict] = []

    class Bare(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None):
            seen.append({"n": input_ids.shape[1]})
            return input_ids

    chunked_prefill(Bare(), _ids(10), CompressedCache(action="none"), 4)
    assert [s["n"] for s in seen] == [4, 4, 2]


def test_a_mask_or_positions_that_do_not_cover_the_prompt_are_clear_errors(model):
    ids = _ids(10)
    with pytest.raises(ValueError, match=r"attention_mask must be \(batch, past \+ n\) = \(1, 10\).*\(1, 9\)"):
        chunked_prefill(model, ids, CompressedCache(action="none"), 4, attention_mask=torch.ones(1, 9))
    with pytest.raises(ValueError, match=r"position_ids must be \(batch, n\) with n = 10; got shape \(1, 4\)"):
        chunked_prefill(model, ids, CompressedCache(action="none"), 4, position_ids=torch.arange(4)[None])
