"""A saved composition's formats list every option: one removed from the file would take the format's default,
which the stored blocks need not share (fitted and min-max ranges hold the same bytes), so loading refuses it;
an option added after the format's first release (``Format.options_added``) may be absent, as in older files."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from safetensors import safe_open
from safetensors.torch import save_file

from kvpolicy import CompressedCache
from kvpolicy.errors import CacheFileError

CASES = {
    "minmax": dict(policy="log", window=4, bits=2, group_size=16, backend="torch"),
    "codebook": dict(policy="log", window=4, bits=3, scheme="codebook", key_centre=True, transform="hadamard"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    out = {}
    for name, kwargs in CASES.items():
        cache = CompressedCache(**kwargs)
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        path = tmp_path_factory.mktemp(name) / "c.kvc"
        cache.save(path, model=model)
        out[name] = (cache, path)
    return out


def _without(src, dst, role: str, option: str):
    with safe_open(str(src), framework="pt") as f:
        header = json.loads(f.metadata()["kvpolicy"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    del header["composition"]["action"]["params"][role]["part"]["params"][option]
    save_file(tensors, str(dst), metadata={"kvpolicy": json.dumps(header)})
    return dst


@pytest.mark.parametrize(
    ("case", "role", "option"),
    [("minmax", "keys", o) for o in ("bits", "group_size", "axis", "fit", "meta_dtype")]
    + [("minmax", "values", "fit"), ("codebook", "keys", "centre"), ("codebook", "values", "bits")],
)
def test_a_saved_format_without_an_option_is_refused_naming_it(saved, tmp_path, case, role, option):
    _, path = saved[case]
    with pytest.raises(CacheFileError, match=rf"the saved format '{case}' lacks its options \['{option}'\]"):
        CompressedCache.load(_without(path, tmp_path / "e.kvc", role, option))


def test_a_saved_codebook_without_norm_bits_loads_as_older_files_do(saved, tmp_path):
    cache, path = saved["codebook"]
    loaded = CompressedCache.load(_without(path, tmp_path / "old.kvc", "keys", "norm_bits"))
    assert loaded.spec.action.keys.norm_bits == 16 == cache.spec.action.keys.norm_bits
