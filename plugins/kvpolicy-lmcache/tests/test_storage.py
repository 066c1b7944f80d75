"""End to end through LMCache's ``StorageManager``: one process stores chunks through an L2 adapter whose
JSON selects the codec, another process loads them, and what it reads is exactly the codec's round trip
of what was stored. Adapters: ``fs`` (a directory) and ``resp`` (a real ``redis-server`` on a loopback
port). A payload damaged in storage, or written by another codec, comes back as a miss: LMCache reports
the load as failed and nothing decoded reaches L1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HERE, chunk, key, redis_sizes
from kvpolicy_lmcache import ChunkCodec

SERDE = {"type": "kvpolicy", "preset": "kvpolicy-3bit"}


def chunks() -> list[dict]:
    """Chunks of several layouts: full and partial bfloat16 chunks, float16 and float32 ones, and a hybrid
    chunk of two groups (K/V layers and a single plane, kept verbatim)."""
    layouts = [
        [chunk(4, 256, 2, 64)],
        [chunk(4, 100, 2, 64, seed=1)],
        [chunk(2, 256, 1, 128, torch.float16, seed=2)],
        [chunk(2, 33, 2, 64, torch.float32, seed=3)],
        [chunk(3, 256, 2, 64, seed=4), torch.randn(1, 2, 256, 96).to(torch.bfloat16)],
    ]
    return [{"hash": bytes([i + 1]) * 32, "model": "test-model", "groups": g} for i, g in enumerate(layouts)]


def run(mode: str, adapter: dict, data: Path, out: Path | None = None) -> None:
    worker = str(HERE / "storage_worker.py")
    cmd = [sys.executable, worker, mode, "--adapter", json.dumps(adapter), "--chunks", str(data)]
    if out is not None:
        cmd += ["--out", str(out)]
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def expected(c: dict, codec: ChunkCodec) -> list[torch.Tensor]:
    groups = c["groups"]
    buf = torch.empty(codec.payload_size([g.shape for g in groups], [g.dtype for g in groups]), dtype=torch.uint8)
    k = key()
    codec.encode(groups, buf, type(k)(chunk_hash=c["hash"], model_name=c["model"], kv_rank=0))
    out = [torch.empty_like(g) for g in groups]
    codec.decode(buf, out, type(k)(chunk_hash=c["hash"], model_name=c["model"], kv_rank=0))
    return out


def sizes(c: dict, codec: ChunkCodec) -> int:
    return codec.payload_size([g.shape for g in c["groups"]], [g.dtype for g in c["groups"]])


@pytest.fixture
def stored(tmp_path, request) -> tuple[dict, list[dict], Path]:
    """An adapter JSON (``fs`` or ``resp``) and chunks stored through it by another process."""
    if request.param == "fs":
        adapter = {"type": "fs", "base_path": str(tmp_path / "l2"), "serde": SERDE}
    else:
        port = request.getfixturevalue("redis_port")
        adapter = {"type": "resp", "host": "127.0.0.1", "port": port, "num_workers": 2, "serde": SERDE}
    data = chunks()
    path = tmp_path / "chunks.pt"
    torch.save(data, path)
    run("store", adapter, path)
    return adapter, data, path


@pytest.mark.parametrize("stored", ["fs", "resp"], indirect=True)
def test_chunks_stored_by_one_process_load_in_another(stored, tmp_path):
    adapter, data, path = stored
    codec = ChunkCodec.from_config({k: v for k, v in SERDE.items() if k != "type"})
    if adapter["type"] == "fs":
        held = sorted(p.stat().st_size for p in Path(adapter["base_path"]).rglob("*") if p.is_file())
    else:
        held = sorted(redis_sizes(adapter["port"]).values())
    assert held == sorted(sizes(c, codec) for c in data)  # the adapter holds the payloads, at their exact size
    run("load", adapter, path, tmp_path / "loaded.pt")
    loaded = torch.load(tmp_path / "loaded.pt")
    for c, got in zip(data, loaded, strict=True):
        assert got is not None, "a stored chunk was not loaded"
        want = expected(c, codec)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("stored", ["fs"], indirect=True)
def test_damaged_or_foreign_payloads_come_back_as_misses(stored, tmp_path):
    adapter, data, path = stored
    files = {p.stat().st_size: p for p in Path(adapter["base_path"]).rglob("*") if p.is_file()}
    codec = ChunkCodec()
    victim = files[sizes(data[0], codec)]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    victim.write_bytes(bytes(raw))
    run("load", adapter, path, tmp_path / "loaded.pt")
    loaded = torch.load(tmp_path / "loaded.pt")
    assert loaded[0] is None and all(x is not None for x in loaded[1:])
    # the same store read by an adapter configured with another codec: every payload refused
    other = {**adapter, "serde": {**SERDE, "seed": 1}}  # payloads of the same size, another rotation
    run("load", other, path, tmp_path / "other.pt")
    assert torch.load(tmp_path / "other.pt") == [None] * len(data)
