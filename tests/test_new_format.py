"""A new quantized tensor format is one file: 8-bit absmax without a zero-point, defined here only.

The format below is everything it takes (a spec, a block, a registration): the ``torch`` backend stores
it and attends over it through the format's own methods, the materialised and the fused decode paths
agree over it, a cache holding it saves and loads, and the backend passes ``check_backend`` with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from conftest import fused_and_materialized, teacher_forced_logits, tiny_model

from kvpolicy import CompressedCache, registry, state_check
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError
from kvpolicy.formats.base import Format, QTensor, check_bits, check_meta_dtype_option
from kvpolicy.hookspecs import hookimpl
from kvpolicy.testing import check_backend


@dataclass
class AbsMaxTensor(QTensor):
    """int8 codes ``(B, H, n, D)`` and one float32 scale per token ``(B, H, n)``: ``x̂ = s · code``."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    shape: tuple[int, int, int, int]
    dtype: torch.dtype

    per_token: ClassVar[bool] = True  # narrow, cat, select and map_batch come from QTensor
    layouts: ClassVar[tuple[str, ...]] = ("test-absmax8-v1",)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales}

    def dequantize(self) -> torch.Tensor:
        return (self.codes.float() * self.scales.unsqueeze(-1)).to(self.dtype)

    def state(self) -> dict:
        return {"layout": "test-absmax8-v1", "codes": self.codes, "scales": self.scales, "shape": list(self.shape),
                "dtype": str(self.dtype).removeprefix("torch.")}  # fmt: skip

    @classmethod
    def from_state(cls, state: dict) -> AbsMaxTensor:
        state_check.entries(state, "absmax block", ("layout", "codes", "scales", "shape", "dtype"))
        b, h, n, d = state_check.shape4(state["shape"], "a block's shape")
        codes = state_check.tensor(state["codes"], "block codes", torch.int8, (b, h, n, d))
        scales = state_check.tensor(state["scales"], "block scales", torch.float32, (b, h, n))
        return cls(codes, scales, 8, (b, h, n, d), state_check.float_dtype(state["dtype"], "a block's dtype"))


@dataclass(frozen=True)
class AbsMax8(Format):
    """8-bit symmetric codes, one scale ``max |x| / 127`` per token and head (no zero-point)."""

    bits: int = 8
    meta_dtype: str = "auto"

    name: ClassVar[str] = "test-absmax8"
    block: ClassVar[type[QTensor]] = AbsMaxTensor
    bits_allowed: ClassVar[tuple[int, ...]] = (8,)

    def __post_init__(self) -> None:
        check_bits("AbsMax8", self.bits, self.bits_allowed)
        check_meta_dtype_option("AbsMax8", self.meta_dtype)

    def quantize(self, x: torch.Tensor, backend: Any = "torch", centre: torch.Tensor | None = None) -> AbsMaxTensor:
        scales = x.float().abs().amax(dim=-1) / 127
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = (x.float() / safe.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
        return AbsMaxTensor(codes, scales, 8, tuple(x.shape), x.dtype)  # type: ignore[arg-type]


class _Plugin:
    @hookimpl
    def kvpolicy_register_formats(self):
        return {"test-absmax8": AbsMax8}


@pytest.fixture
def absmax():
    plugin = _Plugin()
    registry.register(plugin, name="test-absmax8-plugin")
    yield AbsMax8
    registry.unregister(plugin)


KW = dict(action="quantize", bits=8, scheme="test-absmax8", group_size=None, backend="torch")


def test_unregistered_the_scheme_is_refused_with_the_registered_ones():
    with pytest.raises(
        ConfigError, match=r"scheme must be one of \[.*'codebook'.*'minmax'.*\]; got scheme='test-absmax8'"
    ):
        CompressedCache(policy="log", window=8, **KW)


def test_materialised_and_fused_agree(absmax):
    got, ref, cache = fused_and_materialized(**KW)
    assert set(cache.attention_paths().values()) == {"fused (torch)"}
    store = cache.layers[0].engine.held.store
    assert isinstance(store.k.q, AbsMaxTensor) and isinstance(store.v.q, AbsMaxTensor)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)
    assert repr(cache.action) == "Quantize(bits=8, scheme='test-absmax8', check_finite=True)"


def test_close_to_full_precision(absmax):
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    full = teacher_forced_logits(model, ids, 20, DynamicCache())
    got = teacher_forced_logits(model, ids, 20, CompressedCache(policy="log", window=4, **KW))
    assert float((got - full).abs().max()) < 0.05 * float(full.abs().max())


def test_saves_and_loads(absmax, tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(4))
    cache = CompressedCache(policy="log", window=4, **KW)
    with torch.no_grad():
        model(ids[:, :24], cache=cache, use_cache=True)
    cache.save(tmp_path / "c.kvc")
    again = CompressedCache.load(tmp_path / "c.kvc")
    assert repr(again) == repr(cache)
    a, b = cache.layers[0].engine.held.store, again.layers[0].engine.held.store
    assert isinstance(b.k.q, AbsMaxTensor) and torch.equal(a.k.q.codes, b.k.q.codes)
    with torch.no_grad():
        next_a = model(ids[:, 24:], cache=cache, use_cache=True).logits
        next_b = model(ids[:, 24:], cache=again, use_cache=True).logits
    assert torch.equal(next_a, next_b)


def test_passes_check_backend(absmax):
    check_backend(TorchBackend(), formats=[AbsMax8()], bound="reference")
