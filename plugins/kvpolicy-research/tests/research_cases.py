"""What the research plugin's tests share: tiny models, fixtures, and compositions of transforms that fit
something per layer (``"query-hadamard"``, ``"lowrank"``): group flushes with staging non-empty, tier moves,
GQA, batch 2. (Fixtures: conftest.py.)"""

from __future__ import annotations

import torch

from kvpolicy import CompressedCache
from kvpolicy.actions.quantize import Quantize
from kvpolicy.attention import disable_scores, enable_scores
from kvpolicy.fused import attend_parts, disable_fused, enable_fused
from kvpolicy.layer.parts import Part
from kvpolicy.prefill import teacher_forced_logits
from kvpolicy.tiny import random_model

__all__ = ["teacher_forced_logits"]


def tiny_model(family: str, attn: str = "sdpa", layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A tiny random causal LM of ``family`` with head_dim 64 (:func:`kvpolicy.tiny.random_model`)."""
    return random_model(family, layers=layers, seed=seed, attn=attn)


#: a rotated 2-bit codebook cache whose demotions flush per-channel groups of values with staging non-empty
CODEBOOK = {"policy": "log", "window": 8, "bits": 2, "key_scheme": "codebook", "key_centre": True}
MINMAX = {"policy": "log", "window": 8, "bits": 2, "group_size": 16}


def tiered() -> dict:
    """kvpolicy-3bit's shape in miniature: a 4-bit codebook middle tier, then 3/2-bit (tier moves at 75 tokens)."""
    from kvpolicy.actions.tiered import Tiered
    from kvpolicy.policies.log import LogWindow

    tiers = [Quantize(bits=4, scheme="codebook", key_centre=True),
             Quantize(key_bits=3, value_bits=2, scheme="codebook", key_centre=True)]  # fmt: skip
    return {"policy": "log", "window": 4, "action": Tiered(tiers=tiers, keep=[LogWindow(8)])}


def composition(name: str) -> dict:
    """``"codebook"``, ``"minmax-staged"`` (groups of 16 with staging) or ``"tiered"``."""
    return {"codebook": CODEBOOK, "minmax-staged": MINMAX, "tiered": tiered()}[name]


def ids(length: int = 75, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, mode: str, tokens: torch.Tensor, prefill: int, **kw) -> tuple[torch.Tensor, CompressedCache]:
    """Teacher-forced logits under kvpolicy's ``mode`` of attention: ``"fused"``, or ``"scores"`` (its wrapper,
    materialising the history)."""
    enable, disable = (enable_fused, disable_fused) if mode == "fused" else (enable_scores, disable_scores)
    enable(model)
    try:
        if mode != "fused":
            kw = {**kw, "attention": "materialized"}
        cache = CompressedCache(**kw)
        return teacher_forced_logits(model, tokens, prefill, cache), cache
    finally:
        disable(model)


def with_nan(path, out, shape: tuple[int, ...], count: int):
    """A copy of the saved cache ``path`` at ``out`` whose float32 tensors of ``shape`` (``count`` of them, the
    fit of a transform's store: no other saved tensor has that shape and dtype) are NaN."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = f.metadata()
    found = [k for k, t in tensors.items() if tuple(t.shape) == shape and t.dtype == torch.float32]
    assert len(found) == count, {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
    for k in found:
        tensors[k] = tensors[k] * float("nan")
    save_file(tensors, str(out), metadata=meta)
    return out


class Held:
    """An action's store behind a transform's bound basis, driven as a layer drives them: what these tests
    read a transform's tokens through (``Held.of(engine)`` for a layer's)."""

    def __init__(self, transform, action=None, backend=None, rows: int = 1, context=None) -> None:
        from kvpolicy.backends.torch_backend import TorchBackend
        from kvpolicy.transforms import BindContext

        action = action or Quantize(bits=2, scheme="codebook", key_centre=True)
        self.store = action.new_store(backend or TorchBackend(), 0)
        self.store.positions = torch.empty(rows, 0, dtype=torch.int32)
        if context is None:  # layer 0 of 2 KV heads of 64 channels, no model config (what a plain cache tells)
            empty = torch.empty(rows, 2, 0, 64)
            context = BindContext.of(0, empty, empty)
        self.basis = transform.bind(context)

    @classmethod
    def of(cls, engine) -> Held:
        held = cls.__new__(cls)
        held.store, held.basis = engine.held.store, engine.held.basis
        return held

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        if not self.basis.fitted:
            self.basis.fit(keys, values)
        self.basis.add(self.store, keys, values, positions)

    def observe_queries(self, query: torch.Tensor, keys: torch.Tensor) -> None:
        if self.basis.wants_queries:
            self.basis.observe(query, keys)

    def keys(self) -> torch.Tensor:
        return self.basis.unmap_keys(self.store.keys(), self.store.positions)

    def values(self) -> torch.Tensor:
        return self.basis.unmap_values(self.store.values())

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Fused attention over the store's parts alone (an empty full-precision segment)."""
        empty = self.store.keys()[:, :, :0]
        return attend_parts(query, [*self.store.parts(), Part(empty, empty)], scale, self.basis)

    def nbytes(self) -> dict[str, int]:
        out = dict(self.store.nbytes())
        for role, n in self.basis.nbytes().items():
            out[role] = out.get(role, 0) + n
        return out

    def map_batch(self, fn) -> None:
        self.store.map_batch(fn)
        self.basis.map_batch(fn)

    def state_dict(self) -> dict:
        return {"inner": self.store.state_dict(), **self.basis.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state["inner"])
        self.basis.load_state_dict({k: v for k, v in state.items() if k != "inner"}, self.store.positions.device)

    def validate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        held = self.basis.held_dtype(keys.dtype)
        self.store.validate(keys[:, :, :0].to(held), values[:, :, :0].to(held))
        self.basis.validate(keys, values, self.store.positions)

    def __len__(self) -> int:
        return len(self.store)


def fused_and_materialized(family: str = "llama", length: int = 75, **kw):
    """Teacher-forced logits of a tiny GQA model through the fused and the materialised path across group
    flushes with staging non-empty (group 16, window 8, batch 2): ``(fused, materialised, the fused cache)``.
    ``kw`` add or override ``CompressedCache`` keywords (``None`` drops a default)."""
    model = tiny_model(family)
    kw = {k: v for k, v in {"policy": "log", "window": 8, "group_size": 16, **kw}.items() if v is not None}
    got, cache = logits(model, "fused", ids(length), 38, **kw)
    ref, _ = logits(model, "scores", ids(length), 38, **kw)
    return got, ref, cache


def saved_cache_continues(tmp_path, **kw):
    """A cache of ``kw`` filled with 30 tokens of a tiny llama, saved and loaded: asserts the loaded one
    continues with the very logits of a copy of the original; returns ``(cache, loaded)``."""
    import copy

    model, tokens = tiny_model("llama"), ids(40, seed=2)
    cache = CompressedCache(**kw)
    with torch.no_grad():
        model(tokens[:, :30], cache=cache, use_cache=True)
    cache.save(tmp_path / "c.kvc", model=model)
    loaded = CompressedCache.load(tmp_path / "c.kvc", model=model)
    assert repr(loaded) == repr(cache)
    want = teacher_forced_logits(model, tokens[:, 30:], 1, copy.deepcopy(cache))
    assert torch.equal(teacher_forced_logits(model, tokens[:, 30:], 1, loaded), want)
    return cache, loaded
