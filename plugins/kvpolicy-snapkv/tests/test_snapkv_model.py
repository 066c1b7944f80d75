"""SnapKV inside a tiny random Llama (GQA: 4 query heads, 2 kv heads): selection from the model's
own attention, generation with quantize and evict, and loading by name through the entry point."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kvpolicy_snapkv import SnapKV
from transformers import DynamicCache, LlamaForCausalLM

from kvpolicy import CompressedCache, registry
from kvpolicy.attention import enable_scores
from kvpolicy.testing import check_batch_operations

KV_HEADS = 2


def tiny_llama(attn: str = "sdpa", layers: int = 2) -> LlamaForCausalLM:
    """A tiny random Llama (4 query heads, 2 kv heads, head_dim 64) with sharpened attention."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a random init attends almost uniformly: sharpen it
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (batch, length), generator=g)


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_selection_follows_the_observation_windows_attention(pooling):
    prompt, policy = 24, SnapKV(capacity=5, window=4, kernel_size=3, pooling=pooling)
    ids = _ids(2, prompt + 1)
    reference = tiny_llama("eager", layers=1)
    weights = reference(ids[:, :prompt], cache=DynamicCache(), use_cache=True, output_attentions=True).attentions[0]
    b, hq, _, k = weights.shape
    mass = weights[:, :, -policy.window :, :].float().reshape(b, KV_HEADS, hq // KV_HEADS, policy.window, k)
    mass = mass.sum(dim=(0, 2, 3))[:, : prompt - policy.window]  # (kv_heads, prefix)
    pool = torch.nn.functional.avg_pool1d if pooling == "avg" else torch.nn.functional.max_pool1d
    votes = pool(mass[None], 3, stride=1, padding=1)[0]

    model = tiny_llama("sdpa", layers=1)
    enable_scores(model)
    cache = CompressedCache(policy=policy, action="evict")
    model(ids[:, :prompt], cache=cache, use_cache=True)
    model(ids[:, prompt:], cache=cache, use_cache=True)  # the prompt is compressed at this update
    full = cache.positions(0)["full"]
    assert full.shape == (2, KV_HEADS, 5 + 4 + 1)
    for h in range(KV_HEADS):
        top = torch.topk(votes[h], 5).indices.sort().values.tolist()
        assert full[0, h].tolist() == [*top, 20, 21, 22, 23, 24]
        assert torch.equal(full[0, h], full[1, h])
    assert not torch.equal(full[0, 0], full[0, 1])  # the two kv heads chose differently here


@pytest.mark.parametrize("action", ["quantize", "evict"])
def test_generate(action):
    model = tiny_llama("sdpa")
    enable_scores(model)
    ids = _ids(2, 30)
    kwargs = dict(bits=2) if action == "quantize" else {}
    cache = CompressedCache(policy=SnapKV(capacity=6, window=4, recent=3), action=action, **kwargs)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=6, do_sample=False)
    assert out.shape == (2, 36)
    for layer in range(2):
        pos = cache.positions(layer)
        assert pos["full"].shape == (2, KV_HEADS, 6 + 4 + 3)
        assert (pos["full"][..., -3:] == torch.tensor([32, 33, 34])).all()  # the newest 3 generated
        assert pos["compressed"].shape[-1] == (35 - 13 if action == "quantize" else 0)


def test_left_padded_batch():
    """Rows of different prompt lengths each keep capacity + window prompt tokens (row-local positions)."""
    model = tiny_llama("sdpa")
    enable_scores(model)
    ids, mask = _ids(2, 20), torch.ones(2, 20, dtype=torch.long)
    ids[0, :6], mask[0, :6] = 0, 0  # row 0: 14 real tokens
    cache = CompressedCache(policy=SnapKV(capacity=4, window=3), action="evict")
    model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False)
    for layer in range(2):
        rows = cache.positions(layer)["full"]
        for row, real in zip(rows, (14, 20), strict=True):
            assert row.shape == (1, KV_HEADS, 4 + 3 + 3)
            assert (row[0, :, 4:] == torch.arange(real - 3, real + 3)).all()  # window + 3 generated fed back
            assert (row[0, :, :4] < real - 3).all()


@pytest.mark.parametrize("action", ["quantize", "evict"])
def test_batch_operations_move_every_row_with_its_state(action):
    """kvpolicy's batch-operation clause: reorder, select and repeat, right after the prompt and after decode
    steps, give each row the logits of its source row run alone (SnapKV shares one selection across the rows of
    an unpadded batch, so there the clause checks the per-row tensors; a padded batch runs one engine per row)."""
    kwargs = dict(bits=2) if action == "quantize" else {}
    check_batch_operations(lambda: CompressedCache(policy=SnapKV(capacity=6, window=4, recent=3), action=action,
                                                   **kwargs))  # fmt: skip


def test_preset_by_name(monkeypatch):
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    monkeypatch.delenv(registry.ALLOW_ENV, raising=False)
    registry.reset()
    try:
        cache = CompressedCache.from_preset("snapkv", capacity=8, window=4)
        assert cache.policy == SnapKV(capacity=8, window=4) and cache.action.name == "evict"
        (entry,) = [e for e in registry.entries("policies") if e[0] == "snapkv"]
        assert (entry[2].distribution, entry[2].version) == ("kvpolicy-snapkv", "0.1.0")
    finally:
        registry.reset()


def test_by_name_in_a_fresh_interpreter():
    """Installed, the plugin is found through its entry point: nothing imports it by hand."""
    code = (
        "from __future__ import annotations\n"
        + inspect.getsource(tiny_llama)
        + textwrap.dedent(
            """
        import sys
        import torch
        from kvpolicy import CompressedCache
        from kvpolicy.attention import enable_scores

        model = tiny_llama()
        enable_scores(model)
        ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(0))
        print("loaded before:", "kvpolicy_snapkv" in sys.modules)
        for kwargs in (dict(action="quantize", bits=2), dict(action="evict")):
            cache = CompressedCache(policy="snapkv", capacity=6, window=4, **kwargs)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=4,
                                 do_sample=False)
            full = cache.positions(0)["full"]
            print(kwargs["action"], type(cache.policy).__module__, tuple(out.shape), tuple(full.shape))
        """
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in (registry.DISABLE_ENV, registry.ALLOW_ENV)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "loaded before: False"
    # prompt 24 -> 6 + 4 kept; 3 generated tokens fed back are kept too
    assert lines[1] == "quantize kvpolicy_snapkv.policy (1, 28) (1, 2, 13)"
    assert lines[2] == "evict kvpolicy_snapkv.policy (1, 28) (1, 2, 13)"


def test_threads_building_their_first_caches_together_all_find_snapkv():
    """Installed, the plugin is found by every thread that builds its first cache at the same moment as the
    others (the registry loads entry points once, under a lock), and stays found. Each round resets the
    registry and forgets the plugin's modules, so every round is a first lookup."""
    code = textwrap.dedent(
        """
        import json, sys, threading
        from kvpolicy import CompressedCache, registry

        errors, missing_after = [], 0
        for _ in range(10):
            registry.reset()
            for name in [m for m in sys.modules if m.startswith("kvpolicy_snapkv")]:
                del sys.modules[name]
            barrier = threading.Barrier(8)

            def build():
                barrier.wait()
                try:
                    CompressedCache(policy="snapkv", capacity=6, window=4, action="evict")
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")

            threads = [threading.Thread(target=build) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            missing_after += "snapkv" not in registry.names("policies")
        print(json.dumps({"errors": errors, "missing_after": missing_after}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in (registry.DISABLE_ENV, registry.ALLOW_ENV)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == '{"errors": [], "missing_after": 0}'
