"""A real model's KV through LMCache: SmolLM2-135M reads a prompt, its keys and values are cut into 256-token
chunks (the last one partial), stored through a ``StorageManager`` whose ``fs`` adapter runs the codec,
loaded back, put into a ``DynamicCache``, and the model decodes on from it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import key
from kvpolicy_lmcache import ChunkCodec
from kvpolicy_lmcache.hf import from_chunks, to_chunks
from transformers import DynamicCache

from kvpolicy.prefill import teacher_forced_logits
from kvpolicy_lab.quality import next_token_kl

pytestmark = pytest.mark.slow

PROMPT, DECODE = 600, 24


@pytest.fixture(scope="module")
def model_and_ids():
    from kvpolicy_lab.eval.models import load_smollm2
    from kvpolicy_lab.eval.tasks import stdlib_text

    model, tokenizer = load_smollm2()
    ids = torch.tensor(tokenizer.encode(stdlib_text("enum.py"))[: PROMPT + DECODE])[None]
    return model, ids


def storage_manager(tmp_path):
    import argparse

    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.distributed.storage_manager import StorageManager

    adapter = {"type": "fs", "base_path": str(tmp_path), "serde": {"type": "kvpolicy", "preset": "kvpolicy-3bit"}}
    parser = argparse.ArgumentParser()
    add_storage_manager_args(parser)
    args = parser.parse_args(["--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter)])
    return StorageManager(parse_args_to_config(args))


def through_lmcache(chunks: list[torch.Tensor], tmp_path) -> list[torch.Tensor]:
    """Store ``chunks`` through a storage manager, clear its L1, prefetch them back from the fs adapter."""
    import time

    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, PrefetchTaskSpec

    sm = storage_manager(tmp_path)
    try:
        keys = [key(i) for i in range(len(chunks))]
        layouts = [MemoryLayoutDesc(shapes=[c.shape], dtypes=[c.dtype]) for c in chunks]
        for k, layout, c in zip(keys, layouts, chunks, strict=True):
            sm.reserve_write([k], layout)[k].get_tensor(0).copy_(c)
            sm.finish_write([k])
            deadline = time.monotonic() + 120
            while not any(p.name.endswith(k.chunk_hash.hex() + ".data") for p in tmp_path.iterdir()):
                assert time.monotonic() < deadline, "the chunk was not stored"
                time.sleep(0.1)
        time.sleep(1.0)
        sm.clear(force=True)
        out = []
        for k, layout in zip(keys, layouts, strict=True):
            spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=[k], object_group_id=0, layout_desc=layout)])
            handle = sm.submit_prefetch_task(spec)
            assert sm.wait_prefetch_status(handle, timeout=120)
            assert sm.query_prefetch_status(handle).l2_hit_cells[0].popcount() == 1, "not loaded from the fs adapter"
            with sm.read_prefetched_results([k]) as objs:
                out.append(objs[0].get_tensor(0).clone())
            sm.finish_read_prefetched([k])
        return out
    finally:
        sm.close()


def test_a_prompts_chunks_reloaded_continue_decoding(model_and_ids, tmp_path):
    model, ids = model_and_ids
    head_dim = model.config.head_dim
    with torch.inference_mode():
        reference = teacher_forced_logits(model, ids, PROMPT, DynamicCache(config=model.config))
        prompt = DynamicCache(config=model.config)
        model(ids[:, : PROMPT - 1], cache=prompt, use_cache=True)
        chunks = to_chunks(prompt)
        assert [c.shape[2] for c in chunks] == [256, 256, PROMPT - 1 - 512]  # the last one partial

        # without a codec the chunks rebuild the cache exactly: the continuation is the model's own
        plain = teacher_forced_logits(model, ids[:, PROMPT - 1 :], 1, from_chunks(chunks, head_dim, model.config))
        assert float(next_token_kl(reference, plain).max()) < 1e-4

        loaded = through_lmcache(chunks, tmp_path)
        codec = ChunkCodec()
        for c, got in zip(chunks, loaded, strict=True):  # what LMCache loaded is the codec's round trip
            buf = torch.empty(codec.payload_size([c.shape], [c.dtype]), dtype=torch.uint8)
            codec.encode([c], buf, key())
            want = torch.empty_like(c)
            codec.decode(buf, [want], key())
            assert torch.equal(got, want)
        continued = teacher_forced_logits(model, ids[:, PROMPT - 1 :], 1, from_chunks(loaded, head_dim, model.config))
    kl = next_token_kl(reference, continued)
    agree = (reference.argmax(-1) == continued.argmax(-1)).float().mean()
    # 2.7 bits per element for every prompt token: a small distortion, far from a broken cache (a
    # permuted or garbled one gives several nats)
    assert float(kl.mean()) < 0.3 and float(agree) > 0.7, (float(kl.mean()), float(agree))
