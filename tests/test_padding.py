"""Padded batches with a compressed cache: left padding is served row by row, anything else is refused with
PaddingError; action="none" serves every padding as DynamicCache does; padding is read from the attention mask
where the cache sees it (kvpolicy's forward hook, chunked_prefill) and from positions otherwise."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvpolicy import CompressedCache
from kvpolicy.attention import enable_scores
from kvpolicy.errors import ConfigError, PaddingError
from kvpolicy.prefill import chunked_prefill
from kvpolicy.tiny import random_model

Q4 = dict(bits=4, group_size=16)


def _model(hooked: bool, layers: int = 2, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny Llama with kvpolicy's score wrapper (scores for H2O, a key mask for padded eviction); ``hooked``:
    with the forward hook that hands the cache each forward's attention mask, else positions alone."""
    model = random_model("llama", layers=layers).to(dtype)
    enable_scores(model)
    if not hooked:
        model._kvpolicy_release_hook.handles[0].remove()  # the pre-forward hook (the mask); the release one stays
    return model


@pytest.fixture(scope="module")
def hooked():
    return _model(True)


@pytest.fixture(scope="module")
def positions_only():
    return _model(False)


def _batch(rows: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and mask of a batch whose rows are 0/1 mask patterns (tokens at the 1s, pad id 0 at the 0s)."""
    mask = torch.tensor(rows)
    ids = torch.randint(3, 96, mask.shape, generator=torch.Generator().manual_seed(seed)) * mask
    return ids, mask


GENERATE = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_scores=True,
                return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
RIGHT = [[1] * 8, [1] * 5 + [0] * 3]
RIGHT_ONE_TOKEN = [[1] * 8, [1] + [0] * 7]
HOLE = [[1] * 8, [0, 1, 1, 0, 0, 1, 1, 1]]
HOLE_AFTER_FIRST = [[1] * 8, [0, 1, 0, 0, 1, 1, 1, 1]]
PADDING_ONLY = [[1] * 8, [0] * 8]
LEFT = [[1] * 8, [0] * 3 + [1] * 5]
#: layouts a compressed cache refuses: name -> (rows, whether positions alone tell them from left padding)
REFUSED = {
    "right": (RIGHT, True),
    "right, one-token row": (RIGHT_ONE_TOKEN, False),
    "hole": (HOLE, True),
    "hole after the first token": (HOLE_AFTER_FIRST, False),
}


# ---------------------------------------------------------------------- what is refused, and what is not
@pytest.mark.parametrize("layout", list(REFUSED))
def test_padding_that_is_not_on_the_left_is_refused_naming_the_remedy(hooked, layout):
    rows, _ = REFUSED[layout]
    ids, mask = _batch(rows)
    with pytest.raises(PaddingError, match=r"row 1: .*padding_side=\"left\""):
        hooked.generate(ids, attention_mask=mask, cache=CompressedCache(policy="log", window=4, **Q4), **GENERATE)


@pytest.mark.parametrize("layout", [k for k, (_, told) in REFUSED.items() if told])
def test_positions_alone_refuse_what_they_tell_apart(positions_only, layout):
    ids, mask = _batch(REFUSED[layout][0])
    with pytest.raises(PaddingError, match=r"row 1: its positions .*padding_side=\"left\""):
        positions_only.generate(ids, attention_mask=mask, cache=CompressedCache(policy="log", window=4, **Q4),
                                **GENERATE)  # fmt: skip


def test_padding_read_from_positions_alone_says_so(positions_only, monkeypatch):
    """The layouts positions cannot tell from left padding are served as left padding: the one warning says so
    and names the remedy."""
    monkeypatch.setattr("kvpolicy.handoff._warned", set())
    ids, mask = _batch(LEFT)
    with pytest.warns(UserWarning, match=r"padding was read from positions.*watch_forward"):
        positions_only.generate(ids, attention_mask=mask, cache=CompressedCache(policy="log", window=4, **Q4),
                                **GENERATE)  # fmt: skip


def test_the_reported_right_padded_batch_is_refused_rather_than_served_wrong(hooked, positions_only):
    """A right-padded row [tok, tok, pad, pad] with bits=4 and nothing quantized yet was read as pads and one
    token (scores 0.38-0.73 from DynamicCache): it is refused, with or without the mask."""
    ids, mask = _batch([[1, 1, 1, 1], [1, 1, 0, 0]])
    for model in (hooked, positions_only):
        with pytest.raises(PaddingError, match="row 1"):
            model.generate(ids, attention_mask=mask, cache=CompressedCache(policy="log", bits=4), **GENERATE)


def test_right_padding_is_refused_even_while_nothing_is_compressed(hooked):
    """A window longer than the prompt compresses nothing yet, but would later: the cache refuses at once rather
    than serve the padding exactly now and wrongly once it compresses."""
    ids, mask = _batch(RIGHT)
    with pytest.raises(PaddingError, match="row 1"):
        hooked.generate(ids, attention_mask=mask, cache=CompressedCache(policy="recent", window=1000, **Q4),
                        **GENERATE)  # fmt: skip


@pytest.mark.parametrize("layout", [*REFUSED, "left", "a row of padding only"])
@pytest.mark.parametrize("mode", ["hooked", "positions only"])
def test_without_compression_any_padding_equals_dynamic_cache(hooked, positions_only, layout, mode):
    model = hooked if mode == "hooked" else positions_only
    rows = {"left": LEFT, "a row of padding only": PADDING_ONLY}.get(layout) or REFUSED[layout][0]
    ids, mask = _batch(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers warns of right padding
        want = model.generate(ids, attention_mask=mask, cache=DynamicCache(), **GENERATE)
        got = model.generate(ids, attention_mask=mask, cache=CompressedCache(action="none"), **GENERATE)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True))


@pytest.mark.parametrize("mode", ["hooked", "positions only"])
def test_padding_after_the_first_forward_is_refused(hooked, positions_only, mode):
    """An unpadded prompt, then a second multi-token forward (a next turn) padded in one row."""
    model = hooked if mode == "hooked" else positions_only
    cache = CompressedCache(policy="log", window=4, **Q4)
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 26, dtype=torch.long)
    mask[1, 20:22] = 0  # the second turn of row 1 opens with two pads
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.inference_mode():
        model(ids, attention_mask=mask[:, :20], position_ids=positions[:, :20], cache=cache, use_cache=True)
        with pytest.raises(PaddingError, match="new padding after the first step"):
            model(ids[:, :6], attention_mask=mask, position_ids=positions[:, 20:], cache=cache, use_cache=True)


def test_a_padded_row_padded_again_later_is_refused(hooked):
    """A left-padded batch whose second turn pads a row that already holds tokens."""
    cache = CompressedCache(policy="log", window=4, **Q4)
    ids, mask = _batch([[1] * 10, [0] * 4 + [1] * 6])
    more = torch.ones(2, 5, dtype=torch.long)
    more[0, :2] = 0
    with torch.inference_mode():
        hooked(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache, use_cache=True)
        full = torch.cat([mask, more], dim=1)
        with pytest.raises(PaddingError, match=r"row 0: the attention mask marks padding after the row's first token"):
            hooked(ids[:, :5], attention_mask=full, cache=cache, use_cache=True)


def test_a_decode_step_whose_token_the_mask_hides_is_refused(hooked):
    cache = CompressedCache(policy="log", window=4, **Q4)
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 10] = 0
    with torch.inference_mode():
        hooked(ids, attention_mask=mask[:, :10], cache=cache, use_cache=True)
        with pytest.raises(PaddingError, match="new padding after the first step"):
            hooked(ids[:, :1], attention_mask=mask, cache=cache, use_cache=True)


def test_a_mask_of_another_shape_than_the_forward_is_a_clear_error():
    cache = CompressedCache(policy="log", window=4, **Q4)
    cache.note_attention_mask(torch.ones(2, 7))
    with pytest.raises(ValueError, match=r"attention mask of this forward is \(2, 7\).*\(2, 10\)"), torch.no_grad():
        cache.update(torch.zeros(2, 2, 10, 64), torch.zeros(2, 2, 10, 64), 0)
    with pytest.raises(ConfigError, match="note_attention_mask takes"):
        cache.note_attention_mask([[1, 1]])


# ---------------------------------------------------------------------- chunked prefill of a left-padded batch
LENGTHS = (30, 12, 21)


def _left_padded(seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in LENGTHS]
    width = max(LENGTHS)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = 1
    return prompts, ids, mask


@torch.inference_mode()
def _alone(model, make, prompt: torch.Tensor, width: int, chunk: int | None, tokens: torch.Tensor) -> torch.Tensor:
    """The row run alone with its tokens split where the batch's chunks split them (its pads first), then
    teacher-forced ``tokens``: the logits after the prompt and after each token."""
    cache, pad, done = make(), width - len(prompt), 0
    start = pad
    while start < width:
        end = width if chunk is None else min((start // chunk + 1) * chunk, width)
        piece = prompt[None, start - pad : end - pad]
        out = model(piece, position_ids=torch.arange(done, done + piece.shape[1])[None], cache=cache, use_cache=True)
        done, start = done + piece.shape[1], end
    logits = [out.logits[0, -1]]
    for t in tokens:
        out = model(t.view(1, 1), position_ids=torch.tensor([[done]]), cache=cache, use_cache=True)
        logits.append(out.logits[0, -1])
        done += 1
    return torch.stack(logits)


def _greedy_rows(out) -> torch.Tensor:
    return torch.stack(out.logits, 1)


@pytest.mark.parametrize("chunk", [4, 8, 13])
def test_generate_in_chunks_of_a_left_padded_batch_gives_each_row_its_logits_alone(hooked, chunk):
    """Rows whose first chunks are padding only start at their first token, not at the last pad of a chunk."""
    prompts, ids, mask = _left_padded()

    def make():
        return CompressedCache(policy="log", window=4, **Q4)

    kw = dict(GENERATE, output_logits=True, output_scores=False)
    out = hooked.generate(ids, attention_mask=mask, cache=make(), prefill_chunk_size=chunk, **kw)
    for row, prompt in enumerate(prompts):
        want = _alone(hooked, make, prompt, ids.shape[1], chunk, out.sequences[row, ids.shape[1] : -1])
        torch.testing.assert_close(_greedy_rows(out)[row], want, rtol=0, atol=1e-4)


def test_generate_in_chunks_read_from_positions_alone_is_refused_naming_the_remedy(positions_only):
    _, ids, mask = _left_padded()
    with pytest.raises(PaddingError, match=r"row 1: its positions .* do not continue its 1 token.*enable_scores"):
        positions_only.generate(ids, attention_mask=mask, cache=CompressedCache(policy="log", window=4, **Q4),
                                prefill_chunk_size=8, **GENERATE)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [dict(policy="log", window=4, **Q4), dict(policy="sink", sinks=2, window=6, action="evict"),
     dict(policy="h2o", heavy=4, recent=4, **Q4)],
    ids=["log-quantize", "sink-evict", "h2o-quantize"],
)  # fmt: skip
def test_chunked_prefill_of_a_left_padded_batch_gives_each_row_its_logits_alone(positions_only, kwargs):
    """kvpolicy.prefill.chunked_prefill hands the cache each chunk's mask itself (no hook needed) and gives the
    rows the positions generate would."""
    prompts, ids, mask = _left_padded(seed=3)
    chunk = 8
    cache = CompressedCache(**kwargs)
    out = chunked_prefill(positions_only, ids, cache, chunk, attention_mask=mask)
    tokens = torch.randint(3, 96, (3, 3), generator=torch.Generator().manual_seed(4))
    got = [out.logits[:, -1]]
    with torch.inference_mode():
        for t in range(3):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step = positions_only(tokens[:, t : t + 1], attention_mask=mask,
                                  position_ids=mask.sum(-1, keepdim=True) - 1, cache=cache, use_cache=True)  # fmt: skip
            got.append(step.logits[:, -1])
    got = torch.stack(got, 1)
    for row, prompt in enumerate(prompts):
        want = _alone(positions_only, lambda: CompressedCache(**kwargs), prompt, ids.shape[1], chunk, tokens[row])
        torch.testing.assert_close(got[row], want, rtol=0, atol=1e-4)
        assert cache.layers[0].engine.pads[row] == ids.shape[1] - len(prompt)  # no pad was kept as a token


# ---------------------------------------------------------------------- what layer.keys shows
def test_the_keys_of_a_padded_layer_are_its_rows_as_dynamic_cache_holds_them(hooked):
    """Nothing compressed yet: every row's tokens at the columns the mask gives them, as DynamicLayer shows them
    (zeros for pads); once compressed: each row's full-precision segment, right-aligned."""
    _, ids, mask = _left_padded()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, ref = CompressedCache(policy="recent", window=64, **Q4), DynamicCache()
    with torch.inference_mode():
        for c in (cache, ref):
            hooked(ids, attention_mask=mask, position_ids=positions, cache=c, use_cache=True)
    for layer, want in zip(cache.layers, ref.layers, strict=True):
        assert layer.keys.shape == want.keys.shape and layer.values.shape == want.values.shape
        real = mask.bool()[:, None, :, None]
        assert torch.equal(layer.keys, want.keys * real) and torch.equal(layer.values, want.values * real)
    small = CompressedCache(policy="log", window=4, **Q4)
    with torch.inference_mode():
        hooked(ids, attention_mask=mask, position_ids=positions, cache=small, use_cache=True)
        more = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        hooked(ids[:, :1], attention_mask=more, position_ids=positions[:, -1:] + 1, cache=small, use_cache=True)
    engine = small.layers[0].engine
    rows = [row.keys for row in engine.rows]
    width = max(k.shape[2] for k in rows)
    assert small.layers[0].keys.shape == (3, 2, width, 64) and width < ids.shape[1]
    for b, k in enumerate(rows):
        assert torch.equal(small.layers[0].keys[b : b + 1, :, width - k.shape[2] :], k)
    with pytest.raises(RuntimeError, match="assembled from its rows"):
        small.layers[0].keys = torch.zeros(3, 2, 1, 64)


def test_the_history_of_a_padded_layer_is_each_row_alone_right_aligned(hooked):
    """A compressed left-padded batch, after its prompt and a decode step: each layer's materialised history
    (what iterating the cache yields) holds, for every row, the history of that row run alone, right-aligned;
    the zeros before a shorter row's stand where DynamicCache holds its pads."""
    rows, ids, mask = _left_padded()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = CompressedCache(policy="log", window=4, **Q4)
    nxt = torch.full((ids.shape[0], 1), 7)
    with torch.inference_mode():
        hooked(ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        more = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        hooked(nxt, attention_mask=more, position_ids=positions[:, -1:] + 1, cache=cache, use_cache=True)
    alone = []
    for row in rows:
        one = CompressedCache(policy="log", window=4, **Q4)
        with torch.inference_mode():
            hooked(row[None], cache=one, use_cache=True)
            hooked(nxt[:1], cache=one, use_cache=True)
        alone.append(one)
    iterated = list(cache)
    assert len(iterated) == len(cache.layers)
    for i, layer in enumerate(cache.layers):
        keys, values = layer.attention_view()
        assert keys.shape[2] == ids.shape[1] + 1 and torch.equal(iterated[i][0], keys)
        for b, one in enumerate(alone):
            own_k, own_v = layer.engine.rows[b].view()
            n = own_k.shape[2]
            assert torch.equal(keys[b : b + 1, :, -n:], own_k) and torch.equal(values[b : b + 1, :, -n:], own_v)
            assert not keys[b, :, :-n].any() and not values[b, :, :-n].any()
            want_k, want_v = one.layers[i].attention_view()  # the batch's projections round differently
            torch.testing.assert_close(own_k, want_k, rtol=0, atol=1e-4)
            torch.testing.assert_close(own_v, want_v, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------- the property: equal alone, or refused
POLICIES = {
    "log": dict(policy="log", window=2),
    "recent": dict(policy="recent", window=3),
    "sink": dict(policy="sink", sinks=1, window=3),
    "h2o": dict(policy="h2o", heavy=2, recent=2),
    "sinks": dict(policy="recent", window=2, sinks=1),
}
ACTIONS = {"quantize": dict(bits=4, group_size=16), "evict": dict(action="evict")}


@st.composite
def padded_batches(draw: st.DrawFn) -> list[list[int]]:
    """Masks of 1 to 3 rows of one width: left-padded, right-padded, holey or of padding only."""
    width = draw(st.integers(2, 9))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["left", "left", "right", "holey", "padding only"]))
        if kind == "left":
            pads = draw(st.integers(0, width - 1))
            rows.append([0] * pads + [1] * (width - pads))
        elif kind == "right":
            real = draw(st.integers(1, width - 1))
            rows.append([1] * real + [0] * (width - real))
        elif kind == "holey":
            rows.append(draw(st.lists(st.integers(0, 1), min_size=width, max_size=width)))
        else:
            rows.append([0] * width)
    return rows


_PROPERTY_MODEL: list[torch.nn.Module] = []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(rows=[[1, 1, 1, 1], [1, 1, 0, 0]], chunk=None, policy="log", action="quantize", seed=0)  # right padding
@example(rows=[[1, 1, 1, 1], [1, 0, 1, 1]], chunk=None, policy="h2o", action="evict", seed=0)  # a hole after one
@example(rows=[[0, 0, 0, 0, 0, 1, 1, 1], [1] * 8], chunk=3, policy="sink", action="quantize", seed=0)  # pad chunks
@example(rows=[[0, 0, 0, 0, 0, 0, 0, 1], [1] * 8], chunk=2, policy="h2o", action="evict", seed=0)
@example(rows=[[0, 0, 0], [0, 1, 1]], chunk=2, policy="sinks", action="quantize", seed=0)  # padding only
@given(
    rows=padded_batches(), chunk=st.sampled_from([None, 2, 3, 5]), policy=st.sampled_from(sorted(POLICIES)),
    action=st.sampled_from(sorted(ACTIONS)), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_each_row_of_a_padded_batch_equals_the_row_alone_or_the_call_is_refused(rows, chunk, policy, action, seed):
    """Any mask, in chunks or not, any policy: with the mask read (kvpolicy's hook), each row gives the logits of
    its tokens run alone (split where the batch's chunks split them), or the whole call is refused with
    PaddingError, exactly when some row is not left-padded (a row of padding only holds its first token from the
    first decode step on, as the row run alone from that token)."""
    if not _PROPERTY_MODEL:
        _PROPERTY_MODEL.append(_model(True, layers=1, dtype=torch.float64))
    model = _PROPERTY_MODEL[0]

    def make():
        return CompressedCache(**POLICIES[policy], **ACTIONS[action])

    ids, mask = _batch(rows, seed)
    width = ids.shape[1]
    servable = all(not any(r) or all(r[r.index(1) :]) for r in rows)  # a row of padding only starts later
    tokens = torch.randint(3, 96, (len(rows), 2), generator=torch.Generator().manual_seed(seed + 1))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = make()
    got = []
    try:
        with torch.inference_mode():
            for start in range(0, width, chunk or width):
                end = min(start + (chunk or width), width)
                out = model(ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                            cache=cache, use_cache=True)  # fmt: skip
            got.append(out.logits[:, -1])
            for t in range(tokens.shape[1]):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = model(tokens[:, t : t + 1], attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                            cache=cache, use_cache=True)  # fmt: skip
                got.append(out.logits[:, -1])
    except PaddingError as exc:
        assert not servable, f"left padding refused: {rows}: {exc}"
        assert "padding_side" in str(exc)
        return
    assert servable, f"served padding it cannot serve: {rows}"
    got = torch.stack(got, 1)
    for row, bits in enumerate(rows):
        if not any(bits):  # no prompt: the row starts at its first decode token (the prompt's logits are a pad's)
            want = _alone(model, make, tokens[row, :1], 1, None, tokens[row, 1:])
            torch.testing.assert_close(got[row, 1:], want, rtol=0, atol=1e-6)
            continue
        prompt = ids[row, bits.index(1) :]
        want = _alone(model, make, prompt, width, chunk, tokens[row])
        torch.testing.assert_close(got[row], want, rtol=0, atol=1e-6)
