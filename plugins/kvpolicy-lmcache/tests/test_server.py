"""End to end through LMCache's own multiprocess server, started by the plugin's launcher
(``python -m kvpolicy_lmcache server ...``) with a ``resp`` adapter to a real ``redis-server`` whose JSON
selects the codec. A client (LMCache's own benchmark client, CPU workers with paged KV caches) stores a
request's chunks through the server, the server's L1 is cleared, and a second request retrieves them: the
server loads the payloads from redis and decodes them. What the client gets back is exactly the codec's
round trip of what it stored, for a model of one layer group and for a hybrid one of two."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from conftest import chunk, free_port, key, redis_sizes, wait_for_port
from kvpolicy_lmcache import ChunkCodec

SERDE = {"type": "kvpolicy", "preset": "kvpolicy-3bit", "head_dim": 64}
BLOCK = 16
CHUNK = 256


@pytest.fixture
def server(redis_port, tmp_path):
    """LMCache's server with the codec on a resp adapter: ``(rpc port, http port, redis port)``."""
    rpc, http = free_port(), free_port()
    adapter = {"type": "resp", "host": "127.0.0.1", "port": redis_port, "num_workers": 2, "serde": SERDE}
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115 - read back on failure
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpolicy_lmcache", "server", "--host", "127.0.0.1", "--port", str(rpc),
         "--http-host", "127.0.0.1", "--http-port", str(http), "--chunk-size", str(CHUNK), "--l1-size-gb", "0.25",
         "--eviction-policy", "LRU", "--disable-observability", "--supported-transfer-mode", "auto",
         "--l2-adapter", json.dumps(adapter)],
        stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        try:
            wait_for_port(rpc, timeout=180, proc=proc)
            wait_for_port(http, timeout=180, proc=proc)
        except (RuntimeError, TimeoutError) as exc:
            log.seek(0)
            raise RuntimeError(f"{exc}\n{log.read()[-6000:]}") from None
        yield rpc, http, redis_port, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def clear_l1(http: int) -> None:
    req = urllib.request.Request(
        f"http://127.0.0.1:{http}/cache/clear", data=b"{}", method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["status"] == "ok"


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not store the chunks in time")
        time.sleep(0.2)
    time.sleep(1.0)  # the store's completion reaches the server's controllers after the write


def paged_chunk(caches: list[torch.Tensor], first_block: int, index: int) -> torch.Tensor:
    """Chunk ``index`` of a request whose blocks start at ``first_block``, as LMCache lays it out:
    ``[2, layers, 256, heads × head_dim]`` from per-layer paged caches ``(2, blocks, 16, heads, head_dim)``."""
    start = first_block + index * (CHUNK // BLOCK)
    layers = [c[:, start : start + CHUNK // BLOCK].reshape(2, CHUNK, -1) for c in caches]
    return torch.stack(layers, dim=1)


@pytest.mark.parametrize(
    ("spec", "transfer"),
    [
        ("(2,64,16,2,64):bfloat16:3", "engine_driven"),
        # LMCache's engine-driven transfer takes one KV group; several go over shared memory
        ("(2,64,16,2,64):bfloat16:2;(2,64,16,1,128):float16:1", "lmcache_driven"),
    ],
    ids=["one-group", "hybrid"],
)
def test_the_server_stores_and_retrieves_through_the_codec(server, spec, transfer):
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    rpc, http, redis_port, log = server
    config = BenchConfig(
        rpc_url=f"tcp://127.0.0.1:{rpc}", http_url=f"http://127.0.0.1:{http}", mode="cpu",
        transfer_mode=transfer, tp_size=1, use_mla=False, num_tokens=2 * CHUNK - 1, kvcache_shape_spec=spec,
        num_blocks=64, block_size=BLOCK,
    )  # fmt: skip
    client = ServerBenchClient(config, log=lambda message: None)
    client.start()
    try:
        caches = list(client._workers[0].kv_caches.values())
        for i, c in enumerate(caches):  # key-like and value-like data in every block
            heads, dim = c.shape[3], c.shape[4]
            data = chunk(1, c.shape[1] * BLOCK, heads, dim, c.dtype, seed=i)[:, 0]
            c.copy_(data.reshape(2, c.shape[1], BLOCK, heads, dim))
        stored = [c.clone() for c in caches]
        first = client.create_request(1, "store", "cold")
        assert client.store(first, 0, first.num_full_tokens).succeeded
        # once redis holds every chunk, nothing is locked in L1 and clearing it empties it: what the next
        # request reads must come from redis, through the codec
        wait_for(lambda: len(redis_sizes(redis_port)) == first.total_chunks)
        clear_l1(http)
        client.zero_destination(first, 0, first.num_full_tokens)
        client.end_session(first)
        second = client.create_request(1, "retrieve", "warm")
        assert client.lookup(second).is_full_hit
        assert client.retrieve(second, 0, second.num_full_tokens).succeeded
        got = list(caches)
    finally:
        client.close()
    codec = ChunkCodec.from_config({k: v for k, v in SERDE.items() if k != "type"})
    groups = _groups(spec)
    sizes = []
    for index in range(first.total_chunks):
        want = [paged_chunk([stored[i] for i in g], first.block_offset, index) for g in groups]
        size = codec.payload_size([w.shape for w in want], [w.dtype for w in want])
        sizes.append(size)
        buf = torch.empty(size, dtype=torch.uint8)
        codec.encode(want, buf, key())
        decoded = [torch.empty_like(w) for w in want]
        codec.decode(buf, decoded, key())
        for g, d in zip(groups, decoded, strict=True):
            assert torch.equal(paged_chunk([got[i] for i in g], second.block_offset, index), d)
    assert sorted(redis_sizes(redis_port).values()) == sorted(sizes)  # redis holds the payloads, exactly
    log.seek(0)
    assert "coded (head_dim 64)" in log.read()  # the server logged how it stores the layout


def _groups(spec: str) -> list[list[int]]:
    """The layer indices of each layer group of a shape spec, in order."""
    out, layer = [], 0
    for group in spec.split(";"):
        n = int(group.rsplit(":", 1)[1])
        out.append(list(range(layer, layer + n)))
        layer += n
    return out
