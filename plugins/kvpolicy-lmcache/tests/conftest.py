"""Shared helpers of the plugin's tests: chunk keys, memory objects, chunks of several layouts, and a
``redis-server`` on a loopback port (the tests that need one skip only when the binary is absent)."""

from __future__ import annotations

import os

# LMCache reports usage over the network unless told not to; set before lmcache is imported
os.environ["LMCACHE_TRACK_USAGE"] = "false"

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from kvpolicy_lmcache.serde import TensorObj
from lmcache.v1.distributed.api import ObjectKey

HERE = Path(__file__).parent

# The same examples on every run (here and in CI): derived from each test, no example database; tests keep
# their own max_examples. HYPOTHESIS_PROFILE=deep draws fresh ones.
settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True)
settings.register_profile("deep", max_examples=500, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def key(i: int = 1, model: str = "test-model", rank: int = 0, group: int = 0) -> ObjectKey:
    """A chunk key (its hash: 32 bytes of ``i``)."""
    return ObjectKey(chunk_hash=bytes([i % 256]) * 32, model_name=model, kv_rank=rank, object_group_id=group)


Obj = TensorObj  # what LMCache's serializers read of a MemoryObj, over plain tensors


def chunk(layers: int, tokens: int, heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A ``[2, layers, tokens, heads × head_dim]`` chunk shaped like real keys and values: keys share a
    per-channel offset (the outlier channels that key centring removes), norms vary per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, layers, tokens, heads * head_dim, generator=g)
    x[0] += 4 * torch.randn(layers, 1, heads * head_dim, generator=g)
    x *= torch.rand(2, layers, tokens, 1, generator=g) + 0.5
    return x.to(dtype)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Block until something listens on ``127.0.0.1:port`` (or fail, with the process's output if it died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"the process exited with {proc.returncode} before listening on {port}:\n{out[-4000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


@pytest.fixture
def redis_port(tmp_path) -> Iterator[int]:
    """A fresh ``redis-server`` on a loopback port, stopped afterwards (skips only if the binary is absent)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for_port(port, proc=proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def redis_sizes(port: int) -> dict[str, int]:
    """Every key a redis server holds and the length of its value (through ``redis-cli``)."""
    cli = shutil.which("redis-cli")
    assert cli is not None, "redis-cli comes with redis-server"
    keys = subprocess.run([cli, "-p", str(port), "--scan"], capture_output=True, text=True, check=True).stdout.split()
    return {
        k: int(subprocess.run([cli, "-p", str(port), "strlen", k], capture_output=True, text=True, check=True).stdout)
        for k in keys
    }


def section_offsets(codec, groups: list[torch.Tensor], k) -> dict[tuple[int, str, str], tuple[int, int]]:
    """Where each section of a payload lies: ``(group, role, section name) -> (byte offset, bytes)`` (role
    ``"keys"``, ``"values"``, ``"verbatim"`` for the tokens a coded group keeps verbatim, or ``"raw"`` for a
    group stored verbatim)."""
    from kvpolicy_lmcache import payload

    plan = codec.plan([g.shape for g in groups], [g.dtype for g in groups])
    offset = payload.body_offset(len(codec.header(plan, k)))
    out = {}
    for i, g in enumerate(plan):
        if g.mode == "raw":
            n = g.nbytes
            out[(i, "raw", "data")] = (offset, n)
            offset += n
            continue
        if g.first + g.last:
            n = payload.pad(g.dtype.itemsize * 2 * g.shape[1] * (g.first + g.last) * g.shape[3])
            out[(i, "verbatim", "tokens")] = (offset, n)
            offset += n
        for role, tmpl in zip(("keys", "values"), g.templates, strict=False):  # none when every token is kept
            for s in tmpl.sections:
                out[(i, role, s.name)] = (offset, s.nbytes)
                offset += payload.pad(s.nbytes)
    return out


def resign(buf: torch.Tensor) -> None:
    """Recompute a payload's checksum after an edit (as a writer that knows the format could)."""
    from kvpolicy_lmcache import payload

    magic, version, reserved, header_len, total, _ = payload.PREFIX.unpack_from(memoryview(buf.numpy()))
    crc = payload.crc(memoryview(buf.numpy())[payload.PREFIX.size : total])
    fixed = payload.PREFIX.pack(magic, version, reserved, header_len, total, crc)
    buf[: payload.PREFIX.size].copy_(torch.frombuffer(bytearray(fixed), dtype=torch.uint8))
