"""Every policy x every action on tiny Llama, Qwen2, Phi-3, Mistral and Gemma-2, sdpa and eager."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

from kvpolicy import CompressedCache
from kvpolicy.attention import enable_scores
from kvpolicy.policies.h2o import HeavyHitters
from kvpolicy.policies.log import LogWindow
from kvpolicy.policies.recent import RecentWindow
from kvpolicy.policies.sink import SinkWindow
from kvpolicy.prefill import teacher_forced_logits

POLICIES = {
    "log": LogWindow(window=4),
    "recent": RecentWindow(window=10),
    "recent-flush": RecentWindow(window=8, variant="flush", prompt="keep_tail"),
    "sink": SinkWindow(sinks=2, window=8),
    "h2o": HeavyHitters(heavy=5, recent=5),
}
ACTIONS = {"quantize": dict(action="quantize", bits=4, group_size=16), "evict": dict(action="evict")}
PREFIX_LEN, TOTAL = 24, 64


def _gemma2(attn: str) -> torch.nn.Module:
    cfg = Gemma2Config(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=8, max_position_embeddings=4096,
    )  # fmt: skip
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return Gemma2ForCausalLM(cfg).eval()


_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def model_for(family: str, attn: str) -> torch.nn.Module:
    if (family, attn) not in _MODELS:
        model = _gemma2(attn) if family == "gemma2" else tiny_model(family, attn)
        enable_scores(model)  # outputs unchanged; H2O layers get their scores
        _MODELS[(family, attn)] = model
    return _MODELS[(family, attn)]


CASES = [(f, a) for f in ("llama", "qwen2", "phi3", "mistral") for a in ("sdpa", "eager")] + [("gemma2", "eager")]


def _ids(batch: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 96, (batch, TOTAL), generator=torch.Generator().manual_seed(seed))


def _expected_full(policy, length: int, prefill: int) -> list[int] | None:
    """FP positions of a data-independent policy driven like the cache (prefill, then decode)."""
    if policy.needs_scores:
        return None
    state = policy.new_state()
    state.append(prefill)
    for _ in range(length - prefill):
        state.append(1)
    return state.full_positions()


@pytest.mark.parametrize(("family", "attn"), CASES)
@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("action_name", list(ACTIONS))
def test_matrix(family, attn, policy_name, action_name):
    model = model_for(family, attn)
    policy = POLICIES[policy_name]
    config = model.config if family == "gemma2" else None
    ids = _ids()
    cache = CompressedCache(policy=policy, config=config, **ACTIONS[action_name])
    logits = teacher_forced_logits(model, ids, PREFIX_LEN, cache)
    assert logits.shape == (2, TOTAL - PREFIX_LEN, 96) and torch.isfinite(logits).all()
    length = TOTAL - 1  # the last token is never fed
    assert cache.get_seq_length() == length
    layer_idx = 1 if family == "gemma2" else 0  # gemma2's layer 0 is a sliding layer left to transformers
    pos = cache.positions(layer_idx)
    expected = _expected_full(policy, length, PREFIX_LEN)
    if expected is not None:
        assert pos["full"].tolist() == expected
    else:  # per head: (batch, kv_heads, heavy + recent), the newest `recent` in every head
        assert pos["full"].shape[-1] == policy.heavy + policy.recent
        assert (pos["full"][..., -policy.recent :] == torch.arange(length - policy.recent, length)).all()
    n_full = pos["full"].shape[-1]
    report = cache.memory_report()
    dense = DynamicCache(config=model.config)
    teacher_forced_logits(model, ids, PREFIX_LEN, dense)
    dense_bytes = sum(layer.keys.numel() * 4 * 2 for layer in dense.layers)
    assert report.total_bytes < dense_bytes
    if action_name == "evict":
        held = report.layers[layer_idx]
        assert held.segments["codes"] == 0
        b, h = 2, model.config.num_key_value_heads
        assert held.segments["full_precision"] == 2 * b * h * n_full * 64 * 4
        assert pos["compressed"].numel() == 0
    else:
        covered = torch.cat([pos["full"].reshape(-1, n_full)[0], pos["compressed"].reshape(-1, length - n_full)[0]])
        assert sorted(covered.tolist()) == list(range(length))


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "mistral"])
@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("action_name", list(ACTIONS))
def test_eager_and_sdpa_agree(family, policy_name, action_name, stored_blocks):
    """sdpa and eager hidden states differ in the last float bits. Through an uncompressed or evicting
    cache that stays float noise; a quantizing cache can round a key or value that lies at a tie
    between two grid points differently (one code apart, which CPUs of different instruction sets
    hit at different places), and the logits after it then differ by that code's effect."""
    runs = stored_blocks
    ids = _ids(seed=5)
    out = {}
    kept = {}
    for attn in ("sdpa", "eager"):
        runs.append([])
        cache = CompressedCache(policy=POLICIES[policy_name], **ACTIONS[action_name])
        out[attn] = teacher_forced_logits(model_for(family, attn), ids, PREFIX_LEN, cache)
        kept[attn] = cache.positions(0)["full"]
    if POLICIES[policy_name].needs_scores:
        # score-based selection: sdpa and eager hidden states differ in the last float bits, which can flip a
        # near-tie between two tokens' accumulated attention; the selections must still (nearly) coincide
        assert (kept["sdpa"] == kept["eager"]).float().mean() > 0.9
        return
    from kvpolicy.backends.torch_backend import unpack

    sdpa, eager = ([unpack(out.codes, out.bits).int() for *_, out in run] for run in runs)
    assert len(sdpa) == len(eager) and (len(sdpa) > 0) == (action_name == "quantize")
    flips = total = 0
    for a, b in zip(sdpa, eager, strict=True):
        assert ((a - b).abs() <= 1).all()  # a tie rounds to one neighbour or the other, never further
        flips += int((a != b).sum())
        total += a.numel()
    assert flips <= 1e-2 * max(total, 1), (flips, total)
    # without a flipped code the two paths agree to float noise; a flipped 4-bit code of this tiny model
    # moves the later logits by about 5e-4
    tol = 1e-4 if flips == 0 else 1e-2
    torch.testing.assert_close(out["sdpa"], out["eager"], rtol=tol, atol=tol)
    assert torch.equal(kept["sdpa"], kept["eager"])


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("action_name", list(ACTIONS))
def test_generate_equals_forward_loop(policy_name, action_name):
    model = model_for("llama", "sdpa")
    ids = _ids(batch=1, seed=9)[:, :PREFIX_LEN]
    kw = dict(policy=POLICIES[policy_name], **ACTIONS[action_name])
    gen = model.generate(
        ids, attention_mask=torch.ones_like(ids), cache=CompressedCache(**kw), max_new_tokens=30, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    loop = teacher_forced_logits(model, gen.sequences, PREFIX_LEN, CompressedCache(**kw))
    torch.testing.assert_close(torch.stack(gen.logits, dim=1), loop, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_recent_evict_equals_mistral_sliding_window(attn):
    """policy="recent", action="evict", window=R == Mistral with sliding_window=R and DynamicCache, for a
    prompt shorter than R followed by 100+ decoded tokens past R."""
    window = 16
    common = dict(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    sliding = MistralForCausalLM(MistralConfig(sliding_window=window, attn_implementation=attn, **common)).eval()
    with torch.no_grad():
        for name, p in sliding.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    full = MistralForCausalLM(MistralConfig(sliding_window=None, attn_implementation=attn, **common)).eval()
    full.load_state_dict(sliding.state_dict())
    ids = torch.randint(3, 96, (2, 10 + window + 110), generator=torch.Generator().manual_seed(1))
    ref = teacher_forced_logits(sliding, ids, 10, DynamicCache(config=sliding.config))
    cache = CompressedCache(policy="recent", window=window, action="evict")
    got = teacher_forced_logits(full, ids, 10, cache)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    # the windowed model really differs from the full one: the test can fail
    assert not torch.allclose(teacher_forced_logits(full, ids, 10, DynamicCache()), ref, atol=1e-3)
    assert cache.memory_report().layers[0].segments["full_precision"] == 2 * 2 * 2 * window * 64 * 4


def test_eviction_frees_bytes_and_keeps_logical_positions():
    model = model_for("llama", "sdpa")
    ids = _ids(batch=1, seed=11)
    cache = CompressedCache(policy="recent", window=8, action="evict")
    model(ids[:, :PREFIX_LEN], cache=cache, use_cache=True)
    sizes = []
    for t in range(PREFIX_LEN, TOTAL):
        kv_len, kv_offset = cache.get_mask_sizes(1, 0)
        model(ids[:, t : t + 1], cache=cache, use_cache=True)
        sizes.append(cache.memory_report().total_bytes)
        assert cache.get_seq_length() == t + 1  # logical length: RoPE positions of new tokens stay logical
        assert (kv_len, kv_offset) == (8, t + 1 - 8)
        assert cache.positions(0)["full"].tolist() == list(range(t + 1 - 8, t + 1))
    assert len(set(sizes)) == 1  # constant once full


def test_multi_token_update_after_eviction_is_causal():
    """A second turn appended to an evicting cache: correct mask sizes, and no future token visible."""
    model = model_for("llama", "eager")
    ids = _ids(batch=1, seed=13)
    turn1, turn2 = ids[:, :31], ids[:, 31:40]

    def second_turn(tokens: torch.Tensor) -> torch.Tensor:
        cache = CompressedCache(policy="sink", sinks=2, window=6, action="evict")
        model(turn1[:, :30], cache=cache, use_cache=True)
        model(turn1[:, 30:], cache=cache, use_cache=True)  # one decode step: eviction applied
        assert cache.get_mask_sizes(9, 0) == (8 + 9, 31 - 8)
        out = model(tokens, cache=cache, use_cache=True).logits
        assert cache.get_seq_length() == 40
        return out

    out = second_turn(turn2)
    altered = turn2.clone()
    altered[:, -1] = (altered[:, -1] + 1) % 96
    out2 = second_turn(altered)
    torch.testing.assert_close(out2[:, :-1], out[:, :-1], rtol=0, atol=1e-6)  # earlier queries unaffected
    assert not torch.allclose(out2[:, -1], out[:, -1])


@pytest.mark.parametrize("action_name", list(ACTIONS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_chunked_prefill_equals_single_pass_when_nothing_is_demoted(action_name, attn):
    """Chunks after the first are multi-token updates of a non-empty cache: causal mask and positions
    must make them equal a single-pass prefill (here the window is wide enough that nothing is demoted)."""
    model = model_for("llama", attn)
    ids = _ids(batch=2, seed=21)[:, :48]
    single = model(ids, cache=CompressedCache(policy="log", window=32, **ACTIONS[action_name]), use_cache=True)
    cache = CompressedCache(policy="log", window=32, **ACTIONS[action_name])
    chunks = [model(ids[:, a:b], cache=cache, use_cache=True).logits for a, b in ((0, 20), (20, 33), (33, 48))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), single.logits, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 48
