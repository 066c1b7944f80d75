"""Per-role formats: ``Quantize(keys=..., values=...)`` is what the flat keywords build, exactly, and the
defaults the shortcuts fill are the only options the backend may replace (kvpolicy/actions/quantize.py)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import CacheSpec, CompressedCache
from kvpolicy.actions.quantize import Quantize
from kvpolicy.backends._optional import refuse_fitted_ranges
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError
from kvpolicy.formats import Codebook, MinMax
from kvpolicy.layer_bits import layer_actions

#: (shortcut keywords, the formats they must build)
SHORTCUTS = [
    (dict(), MinMax(2, 128, "channel", "mse"), MinMax(2, 64, "token", "minmax")),
    (dict(bits=3, key_fit="minmax"), MinMax(3, 128, "channel"), MinMax(3, 64, "token")),
    (dict(key_bits=4, value_bits=3, value_scheme="codebook", key_group_size=64, key_fit="minmax"),
     MinMax(4, 64, "channel"), Codebook(3)),
    (dict(bits=4, scheme="codebook", key_centre=True, meta_dtype="float32"),
     Codebook(4, "float32", centre=True), Codebook(4, "float32")),
    (dict(bits=2, group_size=32, key_axis="token", value_axis="token", fit="minmax"),
     MinMax(2, 32, "token"), MinMax(2, 32, "token")),
    (dict(value_scheme="codebook", group_size=32), MinMax(2, 32, "channel", "mse"), Codebook(2)),
]  # fmt: skip


@pytest.mark.parametrize("kw, keys, values", SHORTCUTS)
def test_the_shortcuts_build_the_role_formats(kw, keys, values):
    q = Quantize(**kw)
    assert (q.keys, q.values) == (keys, values)
    whole = Quantize(keys=keys, values=values)
    assert whole == q and hash(whole) == hash(q)
    assert repr(whole) == repr(q)  # the shortcut form wherever one builds the action
    assert whole.defaulted == ()  # a format given whole has no defaults to replace


def test_a_role_given_whole_and_the_other_by_shortcuts():
    q = Quantize(keys=MinMax(3, 64, "channel"), bits=2, value_scheme="codebook")
    assert (q.keys, q.values) == (MinMax(3, 64, "channel"), Codebook(2))  # bits=2 reached the values alone
    assert q == Quantize(key_bits=3, value_bits=2, key_group_size=64, key_fit="minmax", value_scheme="codebook")


def test_a_repr_the_shortcuts_cannot_write_gives_the_formats_whole():
    q = Quantize(keys=MinMax(3, 128, "channel", "mse"), values=Codebook(2, meta_dtype="float32"))
    text = repr(q)
    assert text.startswith("Quantize(keys=MinMax(bits=3, group_size=128") and "values=Codebook(" in text
    assert eval(text, {"Quantize": Quantize, "MinMax": MinMax, "Codebook": Codebook}) == q


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(keys=MinMax(2, 64, "token"), key_bits=3), r"\) gives the keys' format whole; \['key_bits'"),
        (dict(values=Codebook(2), value_axis="token"), r"\['value_axis'\] would set it again"),
        (dict(keys=MinMax(2, 64, "token"), values=Codebook(2), bits=3), r"apply to neither; drop bits"),
        (dict(keys="minmax"), r"keys must be a format spec .*got keys='minmax'"),
        (dict(keys=MinMax(2, 64, "token"), values=Codebook(2, centre=True)), r"is centred; only keys are"),
        (dict(keys=MinMax(2, 96, "channel"), values=MinMax(2, 64, "channel")), r"one group size to divide the other"),
        (dict(defaulted=["keys.bits"]), r"defaulted names \['keys.bits'\]"),
        (dict(bits=5, scheme="codebook"), r"'codebook' refuses bits=5: Codebook: bits must be one of \[2, 3, 4\]"),
    ],
)  # fmt: skip
def test_contradicting_or_malformed_roles_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        Quantize(**kw)


class _NoMSE(TorchBackend):
    """The torch backend without fitted ranges (as a backend whose library chooses each group's range)."""

    name = "torch-no-mse"

    def check_format(self, fmt, role=""):
        super().check_format(fmt, role)
        refuse_fitted_ranges(self.name, fmt, role)


def test_serving_replaces_defaults_and_never_a_format_given_whole():
    backend = _NoMSE()
    served, notes = Quantize().serving(backend)
    assert served.keys.fit == "minmax" and "keys.fit" not in served.defaulted
    assert notes == ("key_fit='minmax' (backend 'torch-no-mse' does not fit ranges with the default 'mse')",)
    assert served.serving(backend) == (served, ())  # served once: nothing left to replace
    whole = Quantize(keys=MinMax(2, 128, "channel", "mse"), values=MinMax(2, 64, "token"))
    assert whole.serving(backend) == (whole, ())
    with pytest.raises(ConfigError, match=r"key_fit='mse'; it supports fit in \['minmax'\]"):
        whole.check_backend(backend)
    # the default per-token group of 64 does not divide a head dim of 80: replaced, and only when defaulted
    assert Quantize().serving(TorchBackend(), value_dim=80)[0].values.group_size == 40
    given_64 = Quantize(value_group_size=64)
    assert given_64.serving(TorchBackend(), value_dim=80) == (given_64, ())


def test_layer_widths_keep_every_other_option_and_the_defaults():
    q = Quantize(value_scheme="codebook", key_group_size=32, meta_dtype="float32")
    layer = layer_actions(q, {1: (4, 3)})[1]
    assert layer.keys == MinMax(4, 32, "channel", "mse", "float32") and layer.values == Codebook(3, "float32")
    assert layer.defaulted == q.defaulted == ("keys.fit",)


def test_a_cache_takes_the_role_formats_as_keywords_and_from_a_table():
    whole = CompressedCache(policy="log", window=8, keys=MinMax(3, 64, "channel"), values=MinMax(2, 32, "token"))
    short = CompressedCache(policy="log", window=8, key_bits=3, value_bits=2, key_group_size=64,
                            value_group_size=32, key_fit="minmax")  # fmt: skip
    assert whole.action == short.action and repr(whole) == repr(short)
    table = CacheSpec.resolve(policy="log", window=8, keys={"name": "minmax", "bits": 3, "group_size": 64,
                                                            "axis": "channel"},
                              values={"name": "minmax", "bits": 2, "group_size": 32})  # fmt: skip
    assert table.action == short.action


def test_the_same_cache_either_way_holds_the_same_bytes():
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 300, 64, generator=gen), torch.randn(1, 2, 300, 64, generator=gen)
    caches = [
        CompressedCache(policy="log", window=8, transform="hadamard", key_bits=3, value_scheme="codebook"),
        CompressedCache(policy="log", window=8, transform="hadamard",
                        keys=MinMax(3, 128, "channel", "mse"), values=Codebook(2)),
    ]  # fmt: skip
    outs = [cache.update(keys, values, 0) for cache in caches]
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert caches[0].memory_report().total_bytes == caches[1].memory_report().total_bytes


def test_a_saved_spec_of_per_role_formats_reads_back():
    spec = CacheSpec.resolve(policy="log", keys=MinMax(3, 64, "channel", "mse"), values=Codebook(2),
                             transform="hadamard")  # fmt: skip
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["action"]["params"]["keys"] == {
        "part": {"role": "format", "name": "minmax",
                 "params": {"bits": 3, "group_size": 64, "axis": "channel", "fit": "mse", "meta_dtype": "auto"}},
    }  # fmt: skip
    assert CacheSpec.from_dict(data) == spec


def test_a_composition_saved_with_the_flat_fields_still_reads():
    """Files written before the formats were per role recorded Quantize's seventeen flat fields."""
    flat = {
        "bits": None, "group_size": None, "key_axis": "channel", "value_axis": "token", "check_finite": True,
        "meta_dtype": "auto", "key_group_size": None, "value_group_size": None, "key_bits": 4, "value_bits": 2,
        "scheme": None, "key_scheme": None, "value_scheme": "codebook", "key_centre": False, "fit": None,
        "key_fit": None, "value_fit": None,
    }  # fmt: skip
    data = CacheSpec.resolve(policy="log", transform="hadamard").to_dict()
    data["action"] = {"name": "quantize", "params": flat}
    got = CacheSpec.from_dict(data).action
    assert got == Quantize(key_bits=4, value_bits=2, value_scheme="codebook")
    assert got.defaulted == ("keys.fit", "keys.group_size")  # the defaults stay defaults: served as before


_kinds = st.sampled_from([None, "minmax", "codebook"])


@settings(max_examples=150, deadline=None)
@given(
    bits=st.sampled_from([None, 2, 3, 4]), key_bits=st.sampled_from([None, 2, 4]), key_scheme=_kinds,
    value_scheme=_kinds, key_axis=st.sampled_from([None, "token", "channel"]),
    value_group=st.sampled_from([None, 16, 32]), key_fit=st.sampled_from([None, "minmax", "mse"]),
    meta=st.sampled_from([None, "float32", "bfloat16"]),
)  # fmt: skip
def test_property_every_shortcut_action_is_its_formats(bits, key_bits, key_scheme, value_scheme, key_axis,
                                                       value_group, key_fit, meta):  # fmt: skip
    kw = dict(bits=bits, key_bits=key_bits, key_scheme=key_scheme, value_scheme=value_scheme, key_axis=key_axis,
              value_group_size=value_group, key_fit=key_fit, meta_dtype=meta)  # fmt: skip
    try:
        q = Quantize(**kw)
    except ConfigError:
        return  # a contradiction (a group size for codebook values, a fit for codebook keys): refused, never built
    rebuilt = Quantize(keys=q.keys, values=q.values, check_finite=q.check_finite, defaulted=q.defaulted)
    assert rebuilt == q and rebuilt.defaulted == q.defaulted and repr(rebuilt) == repr(q)
    assert set(q.defaulted) <= {"keys.fit", "keys.group_size", "values.group_size"}  # what serving may replace
    for role, kind in (("keys", "key"), ("values", "value")):
        fmt = getattr(q, role)
        scheme = kw[f"{kind}_scheme"] or "minmax"
        assert fmt.name == scheme
        assert fmt.bits == (key_bits if kind == "key" and key_bits else bits or 2)
        assert fmt.meta_dtype == (meta or "auto")
    back = CacheSpec.from_dict(json.loads(json.dumps(CacheSpec.resolve(action=q).to_dict()))).action
    assert back == q and back.defaulted == q.defaulted
