"""The layer engine (``kvpolicy.layer``) with bare tensors: no model, no transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvpolicy.actions.evict import Evict
from kvpolicy.actions.none import NoCompression
from kvpolicy.actions.quantize import Quantize
from kvpolicy.actions.tiered import Tiered
from kvpolicy.backends.base import dense_attention
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.fused import attend_parts
from kvpolicy.handoff import HandedOff, ticket_of
from kvpolicy.layer.composition import Composition, plan
from kvpolicy.layer.engine import LayerEngine
from kvpolicy.layer.padded import PaddedEngine
from kvpolicy.layer.parts import Part
from kvpolicy.layer.path import StepPath
from kvpolicy.policies import HeavyHitters, LogWindow, RecentWindow
from kvpolicy.transforms import Hadamard, NoTransform

D = 32


def _tokens(n: int, seed: int, batch: int = 1, heads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, n, D, generator=g), torch.randn(batch, heads, n, D, generator=g)


def _engine(policy=None, action=None, transform=None, layout="ordered") -> LayerEngine:
    parts = Composition(
        policy or LogWindow(4), action or Quantize(bits=2, group_size=8), TorchBackend(), transform or NoTransform(),
        layout,
    )  # fmt: skip
    return LayerEngine(parts, 0)


def _run(engine, prompt: int, steps: int, seed: int = 0, batch: int = 1):
    engine = engine.start(*_tokens(0, seed, batch))
    out = engine.step(*_tokens(prompt, seed, batch))
    engine.release()
    for t in range(steps):
        out = engine.step(*_tokens(1, seed + 1 + t, batch))
    return engine, out


# ---------------------------------------------------------------------- the path, a value
def test_a_path_reads_as_the_sentences_attention_paths_shows():
    assert str(StepPath("fused", None, "cpu")) == "fused (cpu)"
    assert str(StepPath("materialized", "multi-token update", "torch")) == "materialized (torch): multi-token update"
    assert str(StepPath("full-precision")) == "full-precision"
    assert str(StepPath("handed out")) == "handed out, not attended"
    noted = StepPath("materialized", "x", "torch").noted("y", "torch")
    assert (noted.kind, noted.reason, str(noted)) == ("materialized", "x; y", "materialized (torch): x; y")
    assert str(StepPath("full-precision").noted("y", "cpu")) == "materialized (cpu): y"
    with pytest.raises(ValueError, match="kind must be one of"):
        StepPath("fast")


# ---------------------------------------------------------------------- the plan
def test_the_plan_says_why_decode_cannot_run_fused():
    kv = dict(device_type="cpu", dtype=torch.float32, key_dim=D, value_dim=D)
    backend = TorchBackend()
    assert plan(LogWindow(4), Quantize(bits=2), backend, auto=False, attention="auto", **kv).fused_reason is None
    assert plan(LogWindow(4), Quantize(bits=2), backend, auto=False, attention="materialized", **kv).fused_reason == (
        "attention='materialized'"
    )
    reason = plan(HeavyHitters(4, 4), Quantize(bits=2), backend, auto=False, attention="auto", **kv).fused_reason
    assert reason == "policy 'h2o' selects per head"
    assert plan(LogWindow(4), NoCompression(), backend, auto=False, attention="auto", **kv).fused_reason == (
        "action 'none' does not compress"
    )
    assert plan(LogWindow(4), Evict(), backend, auto=False, attention="auto", **kv).fused_reason is None


# ---------------------------------------------------------------------- a step
def test_a_decode_step_hands_out_its_parts_and_fused_attention_records_the_path():
    engine, (keys, values) = _run(_engine(), 40, 3)
    assert isinstance(keys, HandedOff) and keys.shape == (1, 2, 43, D) and values.shape == (1, 2, 43, D)
    ticket = ticket_of(keys)
    assert ticket.fusable and ticket.parts[-1].keys is engine.held.keys
    assert str(engine.path) == "handed out, not attended"
    query = torch.randn(1, 4, 1, D, generator=torch.Generator().manual_seed(5))
    got = attend_parts(query, ticket.parts, 0.125)
    k, v = engine.view("ordered")
    ref, _ = dense_attention(query.reshape(1, 2, 2, D), k, v, 0.125)
    torch.testing.assert_close(got, ref.reshape(1, 4, 1, D), rtol=0, atol=1e-5)
    ticket.fused()
    assert str(engine.path) == "fused (torch)"
    engine.step(*_tokens(1, 99))
    with pytest.raises(RuntimeError, match="after that layer changed"):
        ticket.fused()


def test_a_multi_token_step_materialises_and_is_released_once_its_hand_off_is_gone():
    engine = _engine(layout="agnostic").start(*_tokens(0, 0))  # agnostic: a hand-off, not plain tensors
    engine.step(*_tokens(30, 0))
    engine.step(*_tokens(1, 1))
    keys, values = engine.step(*_tokens(100, 2))
    assert isinstance(keys, HandedOff) and not ticket_of(keys).fusable
    assert str(engine.path) == "materialized (torch): multi-token update"
    assert engine.held.pending == 100 and engine.release() == 0  # its hand-off is alive: nothing released
    del keys, values
    assert engine.release() == 100 - 64  # LogWindow splits appends: the crop window (64 tokens) stays pending
    assert engine.held.pending == 64


def test_the_parts_of_every_store_kind_give_the_materialised_attention():
    tiered = Tiered(
        tiers=[Quantize(bits=4, group_size=8, key_axis="token"), Quantize(bits=2, group_size=8)], keep=[LogWindow(2)]
    )
    query = torch.randn(1, 4, 1, D, generator=torch.Generator().manual_seed(7))
    for action, transform in ((Quantize(bits=4, group_size=8), None), (tiered, None), (Quantize(bits=4), Hadamard())):
        engine, (keys, _) = _run(_engine(action=action, transform=transform), 45, 2)
        parts = ticket_of(keys).parts
        assert all(isinstance(p, Part) for p in parts) and parts[-1].backend is None
        basis = ticket_of(keys).basis
        assert basis is engine.held.basis and (basis is None) == (transform is None)
        got = attend_parts(query, parts, 0.125, basis)
        stored = engine.held.store.parts()
        assert [p.backend for p in parts[:-1]] == [p.backend for p in stored]
        again = attend_parts(query, [*stored, Part(engine.keys, engine.values)], 0.125, basis)
        assert torch.equal(got, again)
        k, v = engine.view("ordered")
        ref, _ = dense_attention(query.reshape(1, 2, 2, D), k, v, 0.125)
        torch.testing.assert_close(got, ref.reshape(1, 4, 1, D), rtol=0, atol=0.2)  # quantization error only


def test_a_refused_shape_changes_nothing():
    engine, _ = _run(_engine(), 10, 1)
    before = engine.version
    with pytest.raises(ValueError, match="kv_heads 2 -> 3"):
        engine.step(*_tokens(1, 3, heads=3))
    assert engine.version == before and engine.length == 11


def test_reset_keeps_the_version_growing_and_forgets_the_path():
    engine, _ = _run(_engine(), 10, 1)
    version = engine.version
    assert engine.reset() is engine
    assert engine.version > version and engine.path is None and engine.length == 0
    assert engine.mask_sizes(5) == (5, 0)


def test_state_dict_round_trips_through_a_fresh_engine():
    engine, _ = _run(_engine(), 30, 4)
    fresh = _engine()
    keys = fresh.load_state_dict(engine.state_dict())
    assert keys is not None and fresh.started and fresh.length == 34
    for key, value in engine.positions().items():
        assert torch.equal(value, fresh.positions()[key])
    assert _engine().load_state_dict({"kind": "compressed", "initialized": False}) is None


# ---------------------------------------------------------------------- a padded batch: an engine of engines
def test_a_padded_batch_is_an_engine_of_engines_whose_rows_run_alone():
    pads = [0, 3]
    n = 20
    position_ids = torch.stack([torch.arange(n), torch.cat([torch.zeros(3, dtype=torch.long), torch.arange(n - 3)])])
    k, v = _tokens(n, 0, batch=2)
    batch = _engine(policy=RecentWindow(4)).start(k, v, position_ids)  # the layer starts with the first step's
    assert isinstance(batch, PaddedEngine) and len(batch.rows) == 2
    keys, _ = batch.step(k, v, position_ids=position_ids)
    assert (
        keys.shape == (2, 2, n, D) and str(batch.path) == "materialized (torch): left-padded batch (one layer per row)"
    )
    for t in range(3):
        batch.step(*_tokens(1, 10 + t, batch=2))
    assert batch.length == n + 3 and batch.mask_sizes(1) == (n + 4, 0)
    for row, pad in enumerate(pads):
        alone = _engine(policy=RecentWindow(4)).start(k[row : row + 1, :, :0], v[row : row + 1, :, :0])
        alone.step(k[row : row + 1, :, pad:], v[row : row + 1, :, pad:])
        for t in range(3):
            step = _tokens(1, 10 + t, batch=2)
            alone.step(step[0][row : row + 1], step[1][row : row + 1])
        for key, value in alone.positions().items():
            assert torch.equal(value, batch.positions()[key][row]), (row, key)
    assert batch.reset() is batch.head and not batch.head.started


def test_the_engine_does_not_import_transformers():
    code = (
        "import sys, kvpolicy.layer.engine, kvpolicy.layer.padded, kvpolicy.layer.parts, kvpolicy.spec; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
