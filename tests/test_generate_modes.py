"""``generate`` in every mode transformers exercises a cache with, and a cache reused across calls.

With ``action="none"`` each mode gives exactly ``DynamicCache``'s tokens and logits: greedy, sampling with a
seed, beam search, assisted decoding, ``prefill_chunk_size``, and contrastive search's cache operations (in
transformers 5 contrastive search lives in a Hub ``custom_generate`` repository, not in the library, so
:func:`contrastive` below performs exactly the operations it performs on a cache: ``batch_repeat_interleave``
of the candidates, a forward of all of them, ``batch_select_indices`` of the chosen ones; or, in its low-memory
variant, a forward per candidate and ``crop(-1)``). A static-shape run (``StaticCache``) gives the same tokens
and logits within float rounding.

With compression (the presets and the one-liner) each mode runs, and each step's logits stay within
:data:`TOLERANCE` of the same tokens scored at full precision (docs/reference/limits.md states it).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache, StaticCache

from kvpolicy import CompressedCache, registry

pytestmark = pytest.mark.usefixtures("two_threads")

NEW = 12
#: per generated token, a compressed cache's logits against the same tokens scored at full precision: the KL
#: divergence (nats) of the full-precision distribution from the compressed one, and the largest logit error.
#: Measured on this tiny model (320-token prompts, 12 new tokens): at most 0.0017 and 0.16 over the presets
#: and the one-liner in every mode; the bounds leave a margin of three.
TOLERANCE = {"kl": 5e-3, "logit": 0.5}
MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=20, temperature=0.8),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "chunked-prefill": dict(do_sample=False, prefill_chunk_size=48),
}
#: the presets that need no attention scores, and the one-liner (CompressedCache() at its defaults)
COMPRESSED = [*(p for p in registry.names("presets") if p not in ("h2o", "snapkv")), "one-liner"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def assistant():
    return tiny_model("llama", seed=1)


def _ids(batch: int = 2, length: int = 320, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def _cache(name: str):
    if name == "dynamic":
        return DynamicCache()
    if name == "none":
        return CompressedCache(action="none")
    return CompressedCache() if name == "one-liner" else CompressedCache.from_preset(name)


def _generate(model, ids, cache, mode: str, **extra):
    torch.manual_seed(0)  # sampling draws the same numbers for every cache
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=NEW, min_new_tokens=NEW,
            output_logits=True, output_scores=True, return_dict_in_generate=True, **MODES[mode], **extra,
        )  # fmt: skip


def _same(got, want) -> None:
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits) == NEW
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits, strict=True))


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_with_action_none_is_dynamic_cache_exactly(model, mode):
    ids = _ids()
    _same(_generate(model, ids, _cache("none"), mode), _generate(model, ids, _cache("dynamic"), mode))


def test_assisted_decoding_with_action_none_is_dynamic_cache_exactly(model, assistant):
    ids = _ids(batch=1)
    want = _generate(model, ids, _cache("dynamic"), "greedy", assistant_model=assistant)
    _same(_generate(model, ids, _cache("none"), "greedy", assistant_model=assistant), want)


def test_a_static_shape_cache_gives_the_same_tokens(model):
    ids = _ids()
    static = _generate(model, ids, StaticCache(config=model.config, max_cache_len=ids.shape[1] + NEW), "greedy")
    ours = _generate(model, ids, _cache("none"), "greedy")
    assert torch.equal(ours.sequences, static.sequences)
    for a, b in zip(ours.logits, static.logits, strict=True):  # padded key length: another reduction order
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _within_tolerance(model, out, prompt: int) -> None:
    """The logits generate reported against a full-precision forward over the sequences it returned."""
    with torch.no_grad():
        ref = model(out.sequences).logits[:, prompt - 1 : -1].float()
    got = torch.stack(out.logits, dim=1).float()
    assert bool(torch.isfinite(got).all())
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
    assert float(kl.sum(-1).max()) <= TOLERANCE["kl"]
    assert float((got - ref).abs().max()) <= TOLERANCE["logit"]


@pytest.mark.parametrize("name", COMPRESSED)
def test_every_mode_runs_compressed_within_the_tolerance(model, assistant, name):
    ids = _ids()
    for mode in ("greedy", "sampling", "chunked-prefill"):
        cache = _cache(name)
        out = _generate(model, ids, cache, mode)
        # it compressed something (StreamingLLM's window, 1020 tokens, holds these prompts whole)
        assert cache.memory_report().bits_per_element_16bit < 16 or name == "streamingllm"
        _within_tolerance(model, out, ids.shape[1])
    out = _generate(model, ids[:1], _cache(name), "greedy", assistant_model=assistant)
    _within_tolerance(model, out, ids.shape[1])
    beams = _generate(model, ids, _cache(name), "beam")  # reorder_cache moves every row's state with it
    assert beams.sequences.shape == (4, ids.shape[1] + NEW) and bool(torch.isfinite(beams.sequences_scores).all())


# ---------------------------------------------------------------------- contrastive search's cache operations
@torch.no_grad()
def contrastive(model, ids, cache, steps: int = 6, top_k: int = 4, alpha: float = 0.6, low_memory: bool = False):
    """Contrastive search (Su et al. 2022) as transformers' implementation drives the cache: the top-``k``
    candidates of each row are fed together after ``batch_repeat_interleave(k)`` and the chosen one kept with
    ``batch_select_indices``; or, with ``low_memory``, fed one at a time, each followed by ``crop(-1)``, and the
    chosen one fed again. Returns the sequences and each step's logits ``(batch, steps, vocab)``."""
    out = model(ids, cache=cache, use_cache=True, output_hidden_states=True)
    logits, context = out.logits[:, -1], out.hidden_states[-1]
    b, seqs, all_logits = ids.shape[0], ids, []
    for _ in range(steps):
        all_logits.append(logits)
        top_p, top_ids = logits.softmax(-1).topk(top_k, dim=-1)
        if low_memory:
            hidden, cand = [], []
            for j in range(top_k):
                o = model(top_ids[:, j : j + 1], cache=cache, use_cache=True, output_hidden_states=True)
                hidden.append(o.hidden_states[-1][:, -1])
                cand.append(o.logits[:, -1])
                cache.crop(-1)
            hidden = torch.stack(hidden, 1).reshape(b * top_k, -1)
            cand = torch.stack(cand, 1).reshape(b * top_k, -1)
        else:
            cache.batch_repeat_interleave(top_k)
            o = model(top_ids.reshape(-1, 1), cache=cache, use_cache=True, output_hidden_states=True)
            hidden, cand = o.hidden_states[-1][:, -1], o.logits[:, -1]
        similarity = torch.cosine_similarity(hidden[:, None], context.repeat_interleave(top_k, 0), dim=-1)
        score = (1 - alpha) * top_p - alpha * similarity.amax(-1).view(b, top_k)
        chosen = score.argmax(-1)
        picked = chosen + torch.arange(b) * top_k
        token = top_ids.gather(1, chosen[:, None])
        if low_memory:
            o = model(token, cache=cache, use_cache=True, output_hidden_states=True)
            logits, new = o.logits[:, -1], o.hidden_states[-1][:, -1]
        else:
            cache.batch_select_indices(picked)
            logits, new = cand[picked], hidden[picked]
        context = torch.cat([context, new[:, None]], dim=1)
        seqs = torch.cat([seqs, token], dim=1)
    return seqs, torch.stack(all_logits, dim=1)


@pytest.mark.parametrize("low_memory", [False, True])
def test_contrastive_search_with_action_none_is_dynamic_cache_exactly(model, low_memory):
    ids = _ids(length=40)
    want = contrastive(model, ids, _cache("dynamic"), low_memory=low_memory)
    got = contrastive(model, ids, _cache("none"), low_memory=low_memory)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("name", ["kvpolicy-3bit", "logquant", "one-liner"])
def test_contrastive_search_compressed_keeps_each_rows_chosen_tokens(model, name):
    """The candidates' forward and the selection leave each row's cache as if only its chosen tokens had come:
    feeding those tokens to a copy of the prompt's cache gives the same logits (within float rounding of a batch
    of 2 against one of 8 rows)."""
    ids = _ids()
    cache = _cache(name)
    seqs, logits = contrastive(model, ids, cache)
    fed = _cache(name)
    with torch.no_grad():
        model(ids, cache=fed, use_cache=True)
        again = [model(seqs[:, t : t + 1], cache=fed, use_cache=True).logits[:, -1] for t in range(320, 326)]
    torch.testing.assert_close(torch.stack(again[:-1], 1), logits[:, 1:], rtol=0, atol=1e-3)
    assert cache.get_seq_length() == fed.get_seq_length() == seqs.shape[1]
    for key, value in cache.positions(0).items():
        assert torch.equal(value, fed.positions(0)[key]), key


def test_contrastive_low_memory_crops_single_steps_where_nothing_was_demoted(model):
    """The low-memory variant takes back each candidate's single-token step: served exactly while that step
    demoted nothing (the policy's state is a function of the length), refused by name at a step that did."""
    ids = _ids()
    # a log window of 128 holds up to 384 tokens: none of these steps demotes
    served = contrastive(model, ids, CompressedCache(policy="log", window=128, bits=4, group_size=16),
                         steps=3, low_memory=True)  # fmt: skip
    assert served[0].shape == (2, 323)
    with pytest.raises(ValueError, match=r"single-token step\(s\) that demoted nothing"):
        contrastive(model, ids, CompressedCache(policy="recent", window=8, bits=4, group_size=16), low_memory=True)


# ---------------------------------------------------------------------- one cache, several generate calls
@pytest.mark.parametrize("name", ["kvpolicy-3bit", "one-liner"])
@pytest.mark.parametrize("length", [1, 100, 200, 321, 330, 331])
def test_a_cache_reused_with_a_prompt_no_longer_than_it_holds_is_refused(model, name, length):
    """The first call leaves 331 tokens in the cache (320 + 12 generated, the last not fed); a second call whose
    prompt does not extend them would feed nothing, or feed held tokens again at positions already seen."""
    ids = _ids()
    cache = _cache(name)
    first = _generate(model, ids, cache, "greedy")
    assert cache.get_seq_length() == 331
    prompt = torch.cat([first.sequences, _ids(seed=9)], dim=1)[:, :length]
    with pytest.raises(ValueError, match=r"Build a new cache per generate call, or call cache\.reset\(\)"):
        _generate(model, prompt, cache, "greedy")


@pytest.mark.parametrize("length", [1, 100, 200, 321, 330, 331])
def test_a_reused_cache_with_action_none_does_what_dynamic_cache_does(model, length):
    """action="none" is DynamicCache exactly, misuse included: where DynamicCache serves the reused cache, so does
    it, with the same tokens and logits; where DynamicCache fails (nothing left to feed), it refuses by name."""
    ids = _ids()
    results = []
    for name in ("none", "dynamic"):
        cache = _cache(name)
        first = _generate(model, ids, cache, "greedy")
        prompt = torch.cat([first.sequences, _ids(seed=9)], dim=1)[:, :length]
        try:
            results.append(_generate(model, prompt, cache, "greedy"))
        except Exception as exc:  # DynamicCache fails with whatever the model raises
            results.append(exc)
    ours, theirs = results
    if isinstance(theirs, Exception):
        assert isinstance(ours, ValueError)
        assert "Build a new cache per generate call" in str(ours)
    else:
        _same(ours, theirs)


@pytest.mark.parametrize("mode", ["greedy", "chunked-prefill", "sampling"])
def test_a_conversation_continued_in_the_same_cache_is_dynamic_cache_exactly(model, mode):
    """A second turn given as the whole conversation so far continues the cache: the same tokens and logits as
    DynamicCache, and after cache.reset() the cache serves a new conversation as a fresh one does."""
    ids = _ids()
    ours, theirs = _cache("none"), _cache("dynamic")
    turns = []
    for cache in (ours, theirs):
        first = _generate(model, ids, cache, "greedy")
        second_prompt = torch.cat([first.sequences, _ids(length=20, seed=3)], dim=1)
        turns.append(_generate(model, second_prompt, cache, mode))
    _same(*turns)
    ours.reset()
    _same(_generate(model, ids, ours, "greedy"), _generate(model, ids, _cache("none"), "greedy"))


def test_a_compressed_conversation_continues_and_reset_starts_afresh(model):
    ids = _ids()
    cache = _cache("kvpolicy-3bit")
    first = _generate(model, ids, cache, "greedy")
    second = torch.cat([first.sequences, _ids(length=20, seed=3)], dim=1)
    out = _generate(model, second, cache, "greedy")
    _within_tolerance(model, out, second.shape[1])
    assert cache.get_seq_length() == second.shape[1] + NEW - 1
    cache.reset()
    _same(_generate(model, ids, cache, "greedy"), _generate(model, ids, _cache("kvpolicy-3bit"), "greedy"))
