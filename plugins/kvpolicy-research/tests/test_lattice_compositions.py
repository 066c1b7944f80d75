"""The lattice format through the core's composition-wide checks: batch operations, the autograd and inference
modes, one-byte scales read by the cpu kernel (the same checks the core runs over its own formats)."""

from __future__ import annotations

import test_codebook_norm8 as core_norm8  # the core's tests (tests/ is on pytest's pythonpath)
import test_inference_mode as core_modes
from kvpolicy_research.lattice import Lattice
from research_parts import cpu_kernel, research_parts  # noqa: F401 - fixtures, and the plugin's parts registered
from test_inference_mode import model  # noqa: F401 - the tiny model fixture those checks run on

from kvpolicy.formats import Codebook, MinMax
from kvpolicy.testing import check_batch_operations

LATTICE = dict(policy="log", window=4, bits=2, scheme="lattice", transform="hadamard")


def test_lattice_moves_its_per_row_state_with_its_row():
    check_batch_operations(LATTICE, padded=False)


def test_lattice_state_made_in_inference_mode_serves_every_other_mode(model, monkeypatch):  # noqa: F811
    monkeypatch.setitem(core_modes.COMPOSITIONS, "lattice", LATTICE)
    core_modes.test_state_made_in_inference_mode_serves_every_other_mode(model, "lattice")


def test_the_cpu_kernel_decodes_one_byte_lattice_scales_to_the_very_scales_of_the_format_decoder():
    core_norm8.check_one_byte_scales_in_the_cpu_kernel(
        [(Lattice(2, norm_bits=8), Codebook(3, "float16")),
         (Codebook(4, "float32", norm_bits=8), Lattice(3, "bfloat16", norm_bits=8)),
         (MinMax(4, 32, "channel", meta_dtype="float16"), Lattice(2, norm_bits=8))]
    )  # fmt: skip


def test_cached_lattice_tables_are_never_inference_tensors():
    import torch
    from kvpolicy_research import lattice

    lattice._tables.cache_clear()
    with torch.inference_mode():
        tables = lattice._tables(2, "cpu")
    assert not any(t.is_inference() for t in tables)
