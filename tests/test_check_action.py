"""kvpolicy.testing.check_action: every built-in action meets the action contract, and broken stores fail it,
each naming the clause they break."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvpolicy import Evict, LogWindow, NoCompression, Quantize, RecentWindow, Tiered
from kvpolicy.actions.base import Action, DemotedStore
from kvpolicy.errors import ConfigError
from kvpolicy.layer.parts import Part
from kvpolicy.positions import POSITION_DTYPE
from kvpolicy.testing import action_error_bound, check_action

pytestmark = pytest.mark.usefixtures("one_thread")

BUILT_IN = {
    "none": NoCompression(),
    "evict": Evict(),
    "quantize-default": Quantize(),
    "quantize-3bit": Quantize(bits=3, group_size=32),
    "quantize-4bit-g16": Quantize(bits=4, group_size=16),
    "quantize-8bit-token-keys": Quantize(bits=8, key_axis="token"),
    "quantize-k4v2-minmax": Quantize(key_bits=4, value_bits=2, fit="minmax"),
    "quantize-channel-values": Quantize(bits=4, value_axis="channel", group_size=32),
    "quantize-float32-meta": Quantize(bits=2, meta_dtype="float32"),
    "codebook-2bit": Quantize(bits=2, scheme="codebook"),
    "codebook-4bit": Quantize(bits=4, scheme="codebook"),
    "codebook-keys-minmax-values": Quantize(bits=3, key_scheme="codebook", value_scheme="minmax"),
    "tiered": Tiered(tiers=[Quantize(bits=4, scheme="codebook"), Quantize(bits=2)], keep=[LogWindow(8)]),
    "tiered-3": Tiered(
        tiers=[Quantize(bits=8, key_axis="token"), Quantize(bits=4, scheme="codebook"), Quantize(bits=2)],
        keep=[RecentWindow(window=16), LogWindow(4)],
    ),
}


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_every_built_in_action_meets_the_contract(name):
    check_action(BUILT_IN[name])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("action", [Quantize(bits=4, group_size=16), Quantize(bits=2, scheme="codebook")], ids=repr)
def test_16_bit_tokens(action, dtype):
    check_action(action, dtype=dtype, per_head=True, seed=3)


def test_a_centred_codebook_counts_every_byte_it_holds():
    check_action(Quantize(bits=3, key_scheme="codebook", key_centre=True), per_head=False)


def test_the_bound_shrinks_with_the_width_and_is_zero_for_an_exact_store():
    bounds = [action_error_bound(b, torch.float32) for b in (2, 3, 4, 8)]
    assert bounds == sorted(bounds, reverse=True) and bounds[-1] < 0.01 < bounds[0] < 1
    assert action_error_bound(None, torch.float32) == 0.0


# ------------------------------------------------------------------------------- a plugin action, whole and broken
@dataclass(frozen=True)
class KeepExact(Action):
    """A plugin-style action that keeps demoted tokens exactly (e.g. offloaded); ``store`` picks a store class."""

    store: type = None  # type: ignore[assignment]
    name = "keep-exact"

    def new_store(self, backend: Any, layer_idx: int) -> DemotedStore:
        return (self.store or ExactStore)()


class ExactStore(DemotedStore):
    def __init__(self) -> None:
        self.positions = torch.empty(1, 0, dtype=POSITION_DTYPE)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        self.k = keys.clone() if self.k is None else torch.cat([self.k, keys], dim=2)
        self.v = values.clone() if self.v is None else torch.cat([self.v, values], dim=2)
        self.positions = torch.cat([self.positions, positions], dim=1)

    def keys(self) -> torch.Tensor:
        return self.k

    def values(self) -> torch.Tensor:
        return self.v

    def nbytes(self) -> dict[str, int]:
        return {
            "keys": self.k.numel() * self.k.element_size(), "values": self.v.numel() * self.v.element_size(),
            "positions": self.positions.numel() * self.positions.element_size(),
        }  # fmt: skip

    def map_batch(self, fn) -> None:
        self.k, self.v = fn(self.k), fn(self.v)

    def state_dict(self) -> dict[str, Any]:
        return {"keys": self.k, "values": self.v, "positions": self.positions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.k, self.v, self.positions = state["keys"], state["values"], state["positions"]


class DropsValuesOnSave(ExactStore):
    def state_dict(self) -> dict[str, Any]:
        return {"keys": self.k, "positions": self.positions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.k, self.positions = state["keys"], state["positions"]
        self.v = torch.zeros_like(self.k)


class LiesAboutBytes(ExactStore):
    def nbytes(self) -> dict[str, int]:
        return {**super().nbytes(), "values": 0}


class KeysOutOfOrder(ExactStore):
    def keys(self) -> torch.Tensor:
        return self.k.flip(2)


class IgnoresMapBatch(ExactStore):
    def map_batch(self, fn) -> None:
        return None


class Int64Positions(ExactStore):
    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        super().add(keys, values, positions)
        self.positions = self.positions.long()


class Coarse(ExactStore):
    """Rounds to a tenth: far coarser than the 8 bits it is checked for."""

    def keys(self) -> torch.Tensor:
        return (self.k * 10).round() / 10


class PartsLoseATail(ExactStore):
    """Its fused parts leave out the last ten tokens."""

    def parts(self) -> list[Part]:
        return [Part(self.k[:, :, :-10], self.v[:, :, :-10])]


class PartsFromAnotherRow(ExactStore):
    """Its fused parts swap the batch rows."""

    def parts(self) -> list[Part]:
        return [Part(self.k.flip(0), self.v.flip(0))]


@dataclass(frozen=True)
class HoardingEvict(KeepExact):
    """Says it evicts, keeps everything."""

    keeps_demoted = False


def test_a_whole_plugin_action_passes():
    check_action(KeepExact(), bits=0)


@pytest.mark.parametrize(
    ("action", "bits", "clause"),
    [
        (KeepExact(DropsValuesOnSave), 0, r"saving: after state_dict -> file -> load_state_dict: the values differ"),
        (KeepExact(LiesAboutBytes), 0, r"bytes: nbytes\(\) adds up to \d+, but the store holds \d+ bytes"),
        (KeepExact(KeysOutOfOrder), 0, r"keys and values: keys are off by a relative RMS error of .* \(bound 0\)"),
        (KeepExact(IgnoresMapBatch), 0, r"batch ops: after map_batch\(reorder rows\)"),
        (KeepExact(Int64Positions), 0, r"positions: expected torch.int32"),
        (KeepExact(Coarse), 8, r"keys and values: keys are off by a relative RMS error"),
        (HoardingEvict(), None, r"flags: an evicting action \(keeps_demoted=False\) must hold nothing"),
        (KeepExact(PartsLoseATail), 0, r"parts: parts\(\) hold \d+ tokens, keys\(\) \d+"),
        (KeepExact(PartsFromAnotherRow), 0, r"parts: attention over parts\(\) differs from attention over keys"),
    ],
    ids=["drops-a-tensor-on-save", "nbytes-lies", "keys-out-of-order", "map-batch-ignored", "int64-positions",
         "coarser-than-its-bits", "evicts-but-keeps", "parts-lose-a-tail", "parts-of-another-row"],
)  # fmt: skip
def test_a_broken_store_fails_naming_the_clause(action, bits, clause):
    with pytest.raises(AssertionError, match=clause):
        check_action(action, bits=bits, per_head=False)


def test_a_store_whose_load_raises_fails_the_saving_clause():
    class RefusesToLoad(ExactStore):
        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise ValueError("no")

    with pytest.raises(AssertionError, match=r"saving: ValueError: no"):
        check_action(KeepExact(RefusesToLoad), bits=0, per_head=False)


def test_a_compressing_plugin_action_needs_its_width():
    with pytest.raises(ConfigError, match=r"check_action: .* give bits="):
        check_action(KeepExact())
