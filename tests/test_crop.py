"""crop: assisted decoding's rollback of rejected draft tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

from kvpolicy import CompressedCache
from kvpolicy.attention import enable_scores

KINDS = {
    "log-quantize": dict(policy="log", window=4, action="quantize", bits=4, group_size=16),
    "log-evict": dict(policy="log", window=4, action="evict"),
    "recent-evict": dict(policy="recent", window=6, action="evict"),
    "sink-quantize": dict(policy="sink", sinks=2, window=6, action="quantize", bits=2, group_size=16),
    "flush-quantize": dict(policy="recent", window=8, variant="flush", action="quantize", bits=2, group_size=16),
    "none": dict(action="none"),
}
#: how far the two runs' logits may differ. The verification forward computes the kept tokens' keys and values
#: in a 6-token forward, the reference in a 2-token one: the matmuls differ in shape, so the float32 results
#: differ by rounding (about 1e-7 for DynamicCache). Without quantization that is all; a quantizer may turn such
#: a difference into a code one step apart, which moves the logits by up to about 1e-4 (measured: 1.8e-5 for
#: flush-quantize), while a crop that keeps one wrong token moves them by about 1e-2.
ATOL = {"quantize": 1e-3, "other": 1e-5}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "eager")


@torch.inference_mode()
def _run(model, cache, feeds: list[torch.Tensor], crop_after: int | None = None, crop: int = 0) -> torch.Tensor:
    out = []
    for i, ids in enumerate(feeds):
        out.append(model(ids, cache=cache, use_cache=True).logits[:, -1:])
        if i == crop_after:
            cache.crop(-crop)
    return torch.cat(out[crop_after + 1 :] if crop_after is not None else out, dim=1)


@pytest.mark.parametrize("kind", list(KINDS))
def test_crop_after_a_verification_forward_equals_never_feeding_the_drafts(model, kind):
    ids = torch.randint(3, 96, (2, 60), generator=torch.Generator().manual_seed(0))
    decode = [ids[:, t : t + 1] for t in range(20, 32)]
    after = [ids[:, t : t + 1] for t in range(40, 55)]
    drafts = torch.randint(3, 96, (2, 4), generator=torch.Generator().manual_seed(1))
    # A: a 6-token verification forward whose last 4 tokens are rejected and cropped
    a = CompressedCache(**KINDS[kind])
    verify = torch.cat([ids[:, 32:34], drafts], dim=1)
    got = _run(model, a, [ids[:, :20], *decode, verify, *after], crop_after=1 + len(decode), crop=4)
    # B: the same without the drafts
    b = CompressedCache(**KINDS[kind])
    ref = _run(model, b, [ids[:, :20], *decode, ids[:, 32:34], *after], crop_after=1 + len(decode), crop=0)
    torch.testing.assert_close(got, ref, rtol=0, atol=ATOL["quantize" if "quantize" in kind else "other"])
    assert a.get_seq_length() == b.get_seq_length() == 20 + 12 + 2 + 15
    for key, value in a.positions(0).items():
        assert torch.equal(value, b.positions(0)[key])
    assert a.memory_report().total_bytes == b.memory_report().total_bytes


def test_crop_of_tokens_the_policy_has_seen_refuses(model):
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = CompressedCache(policy="log", window=4, action="quantize", bits=4, group_size=16)
    model(ids[:, :20], cache=cache, use_cache=True)
    model(ids[:, 20:21], cache=cache, use_cache=True)
    refused = r"only the 0 token\(s\) of the latest multi-token update, or the 0 latest single-token step"
    with pytest.raises(ValueError, match=refused):
        cache.crop(-1)
    with pytest.raises(ValueError, match="negative number"):
        cache.crop(3)
    cache.crop(0)


def test_none_action_crop_matches_dynamic_cache(model):
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(3))
    ours, ref = CompressedCache(action="none"), DynamicCache()
    for cache in (ours, ref):
        model(ids[:, :25], cache=cache, use_cache=True)
        cache.crop(-5)
    a = model(ids[:, 20:24], cache=ours, use_cache=True).logits
    b = model(ids[:, 20:24], cache=ref, use_cache=True).logits
    assert torch.equal(a, b)


def test_assisted_generation_runs_and_h2o_is_refused():
    model = tiny_model("llama", "sdpa")
    assistant = tiny_model("llama", "sdpa", seed=0)
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(4))
    kw = dict(attention_mask=torch.ones_like(ids), assistant_model=assistant, max_new_tokens=15, min_new_tokens=15,
              do_sample=False)  # fmt: skip
    cache = CompressedCache(policy="log", window=4, action="quantize", bits=4, group_size=16)
    out = model.generate(ids, cache=cache, **kw)
    assert out.shape == (1, 45) and cache.get_seq_length() == 44
    enable_scores(model)
    with pytest.raises(ValueError, match="cropped"):
        model.generate(ids, cache=CompressedCache(policy="h2o", heavy=4, recent=4, action="evict"), **kw)
