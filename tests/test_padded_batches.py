"""Left-padded batches: every row gives the logits of its prompt run alone with the same policy."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from kvpolicy import CompressedCache
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.policies import HeavyHitters, LogWindow, RecentWindow, SinkWindow

POLICIES = {
    "log": LogWindow(window=4),
    "recent": RecentWindow(window=10),
    "recent-flush": RecentWindow(window=8, variant="flush", prompt="keep_tail"),
    "sink": SinkWindow(sinks=2, window=8),
    "h2o": HeavyHitters(heavy=5, recent=5),
}
ACTIONS = {
    "quantize": dict(action="quantize", bits=4, group_size=16),
    "quantize-agnostic": dict(action="quantize", bits=4, group_size=16, layout="agnostic"),
    "quantize-rotated": dict(action="quantize", bits=4, group_size=16, transform="hadamard"),
    "evict": dict(action="evict"),
}
LENGTHS = (20, 13, 17)
STEPS = 25

_MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def model_for(attn: str, dtype: torch.dtype) -> torch.nn.Module:
    if (attn, dtype) not in _MODELS:
        model = tiny_model("llama", attn).to(dtype)
        enable_scores(model)
        _MODELS[(attn, dtype)] = model
    return _MODELS[(attn, dtype)]


def _prompts(seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 96, (1, n), generator=g) for n in LENGTHS]
    width = max(LENGTHS)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[1] :] = p
        mask[row, width - p.shape[1] :] = 1
    return prompts, ids, mask


def _tolerance(action: str, dtype: torch.dtype) -> float:
    # Quantization is discontinuous: a value within float noise of a rounding boundary can take the other code
    # in a batched run than alone (batched and single matmuls differ in the last bits). In float64 that noise is
    # ~1e-16 and the logits agree to 1e-4 and better; in float32 a flipped code shows as up to ~1e-3.
    return 1e-3 if action.startswith("quantize") and dtype == torch.float32 else 1e-4


CASES = [
    (p, a, attn, dtype)
    for p in POLICIES
    for a in ACTIONS
    for attn in ("sdpa", "eager")
    for dtype in ((torch.float32, torch.float64) if a.startswith("quantize") else (torch.float32,))
    if a != "quantize-rotated" or (attn, dtype) == ("sdpa", torch.float64)  # the rotation is orthogonal to both
]


@pytest.mark.parametrize(("policy_name", "action_name", "attn", "dtype"), CASES)
def test_generate_rows_equal_alone(policy_name, action_name, attn, dtype):
    model = model_for(attn, dtype)
    prompts, ids, mask = _prompts()
    kw = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=0)  # fmt: skip

    def cache() -> CompressedCache:
        return CompressedCache(policy=POLICIES[policy_name], **ACTIONS[action_name])

    batched = model.generate(ids, attention_mask=mask, cache=cache(), **kw)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache(), **kw)
        torch.testing.assert_close(
            torch.stack(batched.logits, 1)[row], torch.stack(alone.logits, 1)[0], rtol=0,
            atol=_tolerance(action_name, dtype),
        )  # fmt: skip
        assert torch.equal(batched.sequences[row, -STEPS:], alone.sequences[0, -STEPS:])


@torch.inference_mode()
def _teacher_forced(model, ids, mask, continuation, cache) -> torch.Tensor:
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    out = [model(ids, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True).logits[:, -1:]]
    for t in range(continuation.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        position_ids = position_ids[:, -1:] + 1
        step = continuation[:, t : t + 1]
        out.append(model(step, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("action_name", list(ACTIONS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_teacher_forced_rows_equal_alone(policy_name, action_name, attn):
    dtype = torch.float64 if action_name.startswith("quantize") else torch.float32
    model = model_for(attn, dtype)
    prompts, ids, mask = _prompts(seed=1)
    continuation = torch.randint(3, 96, (len(prompts), 30), generator=torch.Generator().manual_seed(2))
    kw = dict(policy=POLICIES[policy_name], **ACTIONS[action_name])
    cache = CompressedCache(**kw)
    batched = _teacher_forced(model, ids, mask, continuation, cache)
    for row, prompt in enumerate(prompts):
        alone_cache = CompressedCache(**kw)
        alone = _teacher_forced(model, prompt, torch.ones_like(prompt), continuation[row : row + 1], alone_cache)
        torch.testing.assert_close(batched[row], alone[0], rtol=0, atol=1e-4)
        # each row holds what it holds alone: sinks and windows count real tokens, pads are never held
        mine, theirs = cache.positions(0), alone_cache.positions(0)
        for key in mine:
            assert torch.equal(mine[key][row], theirs[key])
    # bytes: the rows hold no pad token
    report = cache.memory_report()
    assert report.baseline_bytes == sum(n + 30 for n in LENGTHS) * 2 * 64 * 2 * 2 * 2  # 2 layers, 2 kv heads


def test_padded_eviction_without_the_wrapper_refuses_before_answering():
    model = tiny_model("llama", "sdpa")  # attention wrapper not enabled
    disable_scores(model)
    _, ids, mask = _prompts()
    cache = CompressedCache(policy="recent", window=8, action="evict")
    with pytest.raises(RuntimeError, match="enable_scores"):
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, pad_token_id=0)


def test_padded_quantize_needs_no_wrapper_and_beam_search_works():
    model = tiny_model("llama", "sdpa")
    disable_scores(model)
    _, ids, mask = _prompts()
    cache = CompressedCache(policy="log", window=4, action="quantize", bits=4, group_size=16)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6, num_beams=2, pad_token_id=0)
    assert out.shape == (3, max(LENGTHS) + 6)
