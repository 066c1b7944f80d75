"""CompressedCache under tensor parallelism: ``from_pretrained(..., tp_plan="auto")`` on 2 ranks.

One ``torchrun --standalone --nproc_per_node 2`` launch of tests/tp_worker.py (gloo, CPU) runs every
policy x action on a tiny 4-kv-head Llama, tensor-parallel and single-process (each rank computes the
reference itself from the same saved weights), and writes a JSON summary; the tests below assert the
guarantees on it (docs/explanation/scale-out.md states them). About 30 s on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig

from kvpolicy import CompressedCache, distributed
from kvpolicy.errors import ConfigError

WORKER = Path(__file__).with_name("tp_worker.py")
#: the launch's hang guard. Its wall time (about 30 s on 2 idle CPU cores, 2 min on busy ones) is
#: printed by the fixture, not asserted: the machines are shared and noisy
TIMEOUT_S = 300
#: max |logit difference| for action="none" and "evict", and for the quantized replay. Tensor
#: parallelism changes only the order of float32 sums (the row-parallel o_proj / down_proj partial
#: sums, all-reduced; the vocab-parallel embedding), which moves activations by a few ulps: measured
#: 3.3e-7 on logits of magnitude < 1 (a DynamicCache: 2.4e-7); 1e-5 leaves a 30x margin. Quantized
#: runs are not held to it (a rounding tie moved logits by 1e-5 to 4.5e-4 here): their stored state is.
LOGIT_ATOL = 1e-5
#: the share of stored codes that may differ (each one a proved tie); measured 2 of 522240 (3.8e-6)
FLIP_SHARE_MAX = 1e-3
#: smallest relative score gap at an h2o/snapkv selection boundary: far above the relative noise of
#: the scores under tensor parallelism (~1e-6), so no near-tie can flip a selection
SCORE_GAP_MIN = 1e-4
POLICIES = ("log", "recent", "recent-flush", "sink", "h2o", "shared-scores")
ACTIONS = ("none", "evict", "quantize4", "quantize2", "quantize4-hadamard", "quantize-tiered-codebook")


def _snapkv_installed() -> bool:
    try:
        import kvpolicy_snapkv  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    work = tmp_path_factory.mktemp("tp")
    out = work / "summary.json"
    env = {k: v for k, v in os.environ.items() if k not in ("KVPOLICY_DISABLE_PLUGIN_AUTOLOAD", "KVPOLICY_PLUGINS")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
        "--work", str(work), "--out", str(out),
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    wall = time.perf_counter() - start
    assert proc.returncode == 0 and out.exists(), f"torchrun failed after {wall:.1f} s:\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    result["wall_s"] = wall
    print(f"torchrun wall {wall:.1f} s; worker {result['seconds']}")
    return result


def _cases(summary: dict) -> list[dict]:
    return [entry for rank in summary["cases"] for entry in rank]


def test_each_rank_loads_its_own_saved_cache_and_refuses_the_others(summary: dict) -> None:
    """A rank's file holds that rank's heads: it continues bit for bit on its rank, and is refused by
    name on the other rank (with or without ``model=``, saved with or without it) and on the whole model."""
    saved = summary["saved_caches"]
    assert len(saved) == 2
    for rank, entry in enumerate(saved):
        assert entry["own_continues_exactly"], entry
        other = 1 - rank
        for key in ("other_with_model", "other_without_model"):
            assert entry[key] is not None and f"saved by rank {other} of 2 (tensor-parallel size 2)" in entry[key], (
                entry
            )
        unnamed = entry["other_saved_without_model"]
        assert unnamed is not None and f"saved by rank {other} of 2 (no recorded TP size)" in unnamed, entry
        whole = entry["own_on_whole_model"]
        assert whole is not None and "saved under tensor-parallel size 2; the model given runs under 1" in whole, entry


def test_every_case_ran_on_both_ranks(summary: dict) -> None:
    expected = {(p, a) for p in POLICIES for a in ACTIONS}
    if _snapkv_installed():
        expected |= {("snapkv", a) for a in ACTIONS}
    assert summary["world"] == 2
    for rank in summary["cases"]:
        assert {(e["policy"], e["action"]) for e in rank} == expected


def test_each_rank_holds_half_the_heads(summary: dict) -> None:
    for e in _cases(summary):
        assert (e["kv_heads_reference"], e["kv_heads_rank"]) == (4, 2), e
        # half the bytes, plus what every rank holds whole: shared positions, the transform's matrix
        assert e["bytes_rank"] >= e["bytes_reference"] / 2, e
        if e["action"] == "none":
            assert e["bytes_rank"] * 2 == e["bytes_reference"], e
        else:
            assert e["bytes_rank"] <= e["bytes_reference"] / 2 + 4096 + 1024, e


@pytest.mark.parametrize("action", ["none", "evict"])
def test_logits_match_single_process(summary: dict, action: str) -> None:
    assert max(summary["dynamic_cache_logits_max_diff"]) <= LOGIT_ATOL
    for e in _cases(summary):
        if e["action"] == action:
            assert e["logits_max_diff"] <= LOGIT_ATOL, e


def test_prefill_logits_match_for_every_case(summary: dict) -> None:
    # prefill attention sees the uncompressed prompt whatever the composition
    for e in _cases(summary):
        assert e["logits_max_diff_prefill"] <= LOGIT_ATOL, e


def test_positions_identical_on_every_head(summary: dict) -> None:
    for e in _cases(summary):
        assert e["positions_equal"], f"{e['policy']}/{e['action']} rank {e['rank']}: {e['positions_detail']}"


def test_score_selections_are_far_from_ties(summary: dict) -> None:
    scored = [e for e in _cases(summary) if e["policy"] in ("h2o", "snapkv") and e["action"] != "none"]
    assert scored
    for e in scored:
        assert min(e["score_gap_reference"], e["score_gap_rank"]) >= SCORE_GAP_MIN, e


def test_codes_equal_except_at_proved_ties(summary: dict) -> None:
    quantized = [e for e in _cases(summary) if e["action"].startswith("quantize")]
    codes = flipped = 0
    for e in quantized:
        ties, store = e["ties"], e["store"]
        assert not ties["unproven"], f"{e['policy']}/{e['action']} rank {e['rank']}: {ties['unproven']}"
        assert ties["flips_proven"] == ties["flipped"], e
        assert ties["groups_meta_proven"] == ties["groups_meta_differ"], e
        if e["action"] == "quantize-tiered-codebook":
            # what is held is what the calls produced, less the middle tier's codes of tokens moved down
            assert store["flipped"] <= ties["flipped"], e
        else:
            assert store["flipped"] == ties["flipped"], e  # what is held is what the calls produced
        assert store["staging_max_diff"] <= LOGIT_ATOL, e
        codes += ties["codes"]
        flipped += ties["flipped"]
    share = flipped / codes
    print(f"codes differing from single-process: {flipped} of {codes} ({share:.1e}), every one a proved tie")
    assert share <= FLIP_SHARE_MAX


def test_stored_state_is_the_whole_quantized_difference(summary: dict) -> None:
    # the reference rerun with the ranks' stored codes and metadata gives the tensor-parallel logits
    replayed = summary["replay_logits_max_diff"]
    assert replayed and all(v is not None and v <= LOGIT_ATOL for v in replayed.values()), replayed


def test_hadamard_seeded_identically(summary: dict) -> None:
    assert summary["hadamard_identical_across_ranks"]
    for e in _cases(summary):
        if e["action"] in ("quantize4-hadamard", "quantize-tiered-codebook"):
            assert e["hadamard_same_as_reference"], e


def test_shared_score_policy_sees_every_head(summary: dict) -> None:
    shared = [e for e in _cases(summary) if e["policy"] == "shared-scores" and e["action"] != "none"]
    assert all(e["shared_rows_seen"] == [4] for e in shared), shared  # gathered: the 4 heads, not 2
    # and it matters: some rank's own heads alone would have chosen other tokens
    assert any(e["shared_local_would_differ"] for e in shared)


def test_kv_heads_the_tp_size_does_not_divide(summary: dict) -> None:
    for rank in summary["bad_heads"]:
        # transformers loads the model (each rank gets 24 of the 48 k_proj rows: 1.5 heads) and then
        # fails inside the attention, before any cache is reached
        assert rank["loaded"] and rank["k_proj_local_rows"] == 24
        assert rank["forward"]["raised"] == "RuntimeError" and "is invalid for input" in rank["forward"]["message"]
        # kvpolicy says why, as soon as it can see the model
        for check in ("check_model", "check_config", "cache_with_config"):
            assert rank[check]["raised"] == "ConfigError", rank
            message = rank[check]["message"]
            assert "num_key_value_heads=3" in message and "tp_size=2" in message and "[1, 3]" in message


# ---------------------------------------------------------------------- the helpers, in one process
class _Distributed:
    """What transformers stores on a model config loaded with ``tp_plan``: ``config.distributed_config``."""

    def __init__(self, tp_size: int, tp_plan: object = "auto") -> None:
        self.tp_size, self.tp_plan = tp_size, tp_plan


def _config(kv_heads: int, tp_size: int | None, tp_plan: object = "auto") -> LlamaConfig:
    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=kv_heads, num_hidden_layers=1)
    if tp_size is not None:
        config.distributed_config = _Distributed(tp_size, tp_plan)
    return config


def test_check_kv_heads_names_the_counts_and_the_sizes_allowed() -> None:
    distributed.check_kv_heads(4, 2)
    distributed.check_kv_heads(3, 1)
    with pytest.raises(ConfigError, match=r"num_key_value_heads=6 .* tp_size=4 .*: \[1, 2, 3, 6\]"):
        distributed.check_kv_heads(6, 4)


def test_cache_with_config_refuses_heads_the_tp_size_does_not_divide() -> None:
    CompressedCache(policy="recent", window=4, action="evict", config=_config(3, None))  # not sharded
    CompressedCache(policy="recent", window=4, action="evict", config=_config(6, 2))
    with pytest.raises(ConfigError, match="num_key_value_heads=3 is not divisible by the tensor-parallel size"):
        CompressedCache(policy="recent", window=4, action="evict", config=_config(3, 2))
    # a plan that keeps the key projection whole (its output gathered) splits no head
    distributed.check_config(_config(3, 2, {"layers.*.self_attn.k_proj": "colwise_rep"}))


def test_gather_heads_is_a_no_op_without_a_process_group() -> None:
    scores = torch.rand(1, 2, 5)
    assert distributed.gather_heads(scores, torch.nn.Linear(2, 2)) is scores


def _worker_module():
    """tests/tp_worker.py as a module (its analysis helpers, in one process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvpolicy_tp_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_codebook_tie_analysis_proves_a_flip_at_an_edge_and_refuses_a_real_difference() -> None:
    """The codebook branch of the worker's tie analysis: a code flipped by an input moved a hair across a
    codebook edge is a proved tie (its vector's scale may differ); a code moved by a real change is not."""
    from kvpolicy.backends.torch_backend import TorchBackend
    from kvpolicy.formats import codebook

    w = _worker_module()
    backend = TorchBackend()
    x = torch.randn(1, 2, 6, 32, generator=torch.Generator().manual_seed(0))
    centre = x.mean(dim=2, keepdim=True)
    q = backend.quantize(x, 3, None, "token", scheme="codebook", centre=centre)
    calls = [(x, q)]
    same = w.tie_analysis(calls, calls, slice(0, 2))
    assert (same["codes"], same["flipped"], same["groups"], same["unproven"]) == (x.numel(), 0, 12, [])
    # the coordinate nearest a codebook edge, pushed just across it
    _, edges = codebook._tables(3, "cpu")
    u, norm = w._unit(x, q)
    distance = u.unsqueeze(-1) - edges
    nearest = distance.abs().amin(-1)
    flat = int(nearest.argmin())
    b, h, t, d = torch.unravel_index(torch.tensor(flat), u.shape)
    edge = edges[distance[b, h, t, d].abs().argmin()]
    step = float(edge - u[b, h, t, d])
    nudged = x.clone()
    nudged[b, h, t, d] += (step * 1.2 + 1e-5 * (1 if step > 0 else -1)) * float(norm[b, h, t]) / 32**0.5
    qn = backend.quantize(nudged, 3, None, "token", scheme="codebook", centre=q.centre)
    tie = w.tie_analysis(calls, [(nudged, qn)], slice(0, 2))
    assert nearest.min() < 1e-3 and tie["flipped"] == 1, tie
    assert tie["unproven"] == [] and tie["flips_proven"] == 1
    assert tie["groups_meta_proven"] == tie["groups_meta_differ"]
    # a real change of one coordinate: the flips are not ties
    moved = x.clone()
    moved[0, 0, 0] += 1.0
    qm = backend.quantize(moved, 3, None, "token", scheme="codebook", centre=q.centre)
    real = w.tie_analysis(calls, [(moved, qm)], slice(0, 2))
    assert real["flipped"] > 0 and real["flips_proven"] < real["flipped"] and real["unproven"]
    # a centre that moved beyond a rounding tie is named
    shifted = backend.quantize(x, 3, None, "token", scheme="codebook", centre=centre + 0.1)
    assert any("centres differ" in m for m in w.tie_analysis(calls, [(x, shifted)], slice(0, 2))["unproven"])
