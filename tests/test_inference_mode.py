"""A cache filled under one of torch's grad modes and continued under another gives the same logits.

A tensor made under ``torch.inference_mode()`` cannot be updated in place or saved for autograd outside it.
Every part that allocates state during a prefill (segments, stores and their staging, centres, fits and
low-rank coefficient tables, tiers, transforms' weights and matrices, policies' states such as H2O's scores,
shared positions) must survive a prefill inside the mode followed by decoding outside it, the reverse, and
``torch.no_grad()`` or plain autograd-recording calls in between, with the same logits as a run under one mode.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from kvpolicy import CompressedCache, registry
from kvpolicy.actions.quantize import Quantize
from kvpolicy.actions.tiered import Tiered
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.policies.log import LogWindow
from kvpolicy.prefill import chunked_prefill

pytestmark = pytest.mark.usefixtures("one_thread")

Q = {"group_size": 16}
#: one composition per part that holds state of its own, besides every built-in preset
COMPOSITIONS = {
    "log-minmax": dict(policy="log", window=4, bits=2, **Q),
    "per-token-keys": dict(policy="log", window=4, bits=3, key_axis="token", **Q),
    "hadamard": dict(policy="log", window=4, bits=2, transform="hadamard", **Q),
    "codebook-centred": dict(policy="log", window=4, bits=3, scheme="codebook", key_centre=True, transform="hadamard"),
    "tiered": dict(
        policy="log",
        window=4,
        action=Tiered(tiers=[Quantize(bits=4, key_axis="token", **Q), Quantize(bits=2, **Q)], keep=[LogWindow(4)]),
    ),
    "h2o": dict(policy="h2o", heavy=4, recent=4, bits=2, **Q),
    "h2o-evict": dict(policy="h2o", heavy=4, recent=4, action="evict"),
    "sink-evict": dict(policy="sink", sinks=2, window=6, action="evict"),
    "flush": dict(policy="recent", window=8, variant="flush", bits=4, **Q),
    "none": dict(action="none"),
    **{name: name for name in registry.names("presets")},  # every preset registered
}

MODES = {
    "inference": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": torch.enable_grad,  # a plain call: autograd records what involves the model's parameters
}
#: (prefill mode, decode mode, a second prefill-like multi-token step's mode)
SEQUENCES = [
    ("inference", "grad", "inference"),
    ("inference", "no_grad", "grad"),
    ("grad", "inference", "no_grad"),
    ("no_grad", "inference", "grad"),
]


def _cache(spec) -> CompressedCache:
    return CompressedCache.from_preset(spec) if isinstance(spec, str) else CompressedCache(**spec)


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama")
    enable_scores(m)  # H2O's scores
    yield m
    disable_scores(m)


def _run(model, spec, ids: torch.Tensor, modes: tuple[str, str, str], chunk: int | None = None) -> torch.Tensor:
    """Logits of a 40-token prefill, 12 decode steps, a 6-token step and 6 more decode steps, each phase under its
    mode (``chunk``: the prefill through ``chunked_prefill``, which runs under inference mode itself)."""
    cache, out = _cache(spec), []
    with MODES[modes[0]]():
        if chunk is None:
            out.append(model(ids[:, :40], cache=cache, use_cache=True).logits[:, -1:])
        else:
            out.append(chunked_prefill(model, ids[:, :40], cache, chunk).logits[:, -1:])
    for lo, hi, mode in ((40, 52, 1), (52, 58, 2), (58, 64, 1)):
        with MODES[modes[mode]]():
            steps = [ids[:, lo:hi]] if mode == 2 else [ids[:, t : t + 1] for t in range(lo, hi)]
            out += [model(s, cache=cache, use_cache=True).logits[:, -1:] for s in steps]
    cache.memory_report()  # reads (and settles) the held state outside every mode
    return torch.cat([o.detach() for o in out], dim=1)


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_state_made_in_inference_mode_serves_every_other_mode(model, name):
    ids = torch.randint(3, 96, (2, 64), generator=torch.Generator().manual_seed(0))
    want = _run(model, COMPOSITIONS[name], ids, ("no_grad", "no_grad", "no_grad"))
    for modes in SEQUENCES:
        got = _run(model, COMPOSITIONS[name], ids, modes)
        assert torch.equal(got, want), modes
    got = _run(model, COMPOSITIONS[name], ids, ("grad", "grad", "grad"), chunk=16)
    assert torch.isfinite(got).all()
    with torch.no_grad():  # chunked prefill (inference mode) then plain calls: the same logits as chunked, no_grad
        again = _run(model, COMPOSITIONS[name], ids, ("no_grad", "no_grad", "no_grad"), chunk=16)
    assert torch.equal(got, again)


def test_save_and_positions_after_an_inference_mode_prefill(model, tmp_path):
    """Reading a cache (positions, bytes, save) settles deferred demotions, which write the store in place."""
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = _cache(COMPOSITIONS["codebook-centred"])
    chunked_prefill(model, ids, cache, 16)
    cache.positions(0)
    cache.save(tmp_path / "c.kvc", model=model)
    assert CompressedCache.load(tmp_path / "c.kvc", model=model).get_seq_length() == 40


def test_cached_format_tables_are_never_inference_tensors():
    """A table cached on its first use must serve every later mode: a first use under inference mode (a
    chunked prefill) must not cache an inference tensor that autograd later refuses to save."""
    from kvpolicy.formats import codebook, scale_codes

    codebook._TABLES.clear()
    scale_codes._OCTAVE_STEPS.clear()
    with torch.inference_mode():
        tables = [*codebook._tables(3, "cpu"), scale_codes.octave_steps("cpu")]
    assert not any(t.is_inference() for t in tables)
    weight = torch.ones(8, requires_grad=True)
    (weight * codebook.centroids(3)).sum().backward()  # raises if the cached table is an inference tensor
