"""The codec as LMCache's serde registry sees it: registered types, processors built from an adapter's
``"serde"`` entry through LMCache's own factory, bad entries refused naming the key, and the serializer and
deserializer on LMCache's memory objects."""

from __future__ import annotations

import subprocess
import sys

import kvpolicy_lmcache
import pytest
import torch
from conftest import Obj, chunk, key
from kvpolicy_lmcache import ChunkCodec
from kvpolicy_lmcache.serde import PRESET_TYPES, TYPE, KVPolicyDeserializer, KVPolicySerializer, create
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor, get_registered_serde_types

from kvpolicy.errors import ConfigError


def test_importing_registers_every_type_once():
    assert {TYPE, *PRESET_TYPES} <= set(get_registered_serde_types())
    kvpolicy_lmcache.register()  # again: nothing raises, nothing is registered twice
    assert sorted(get_registered_serde_types()).count(TYPE) == 1


@pytest.mark.parametrize(
    ("config", "preset"),
    [
        (SerdeConfig(type="kvpolicy"), "kvpolicy-3bit"),
        (SerdeConfig(type="kvpolicy", kwargs={"preset": "kvpolicy-4bit", "max_workers": 2}), "kvpolicy-4bit"),
        (SerdeConfig(type="kvpolicy-3.5bit", kwargs={"seed": 3}), "kvpolicy-3.5bit"),
    ],
)
def test_lmcaches_factory_builds_the_processor(config, preset):
    processor = create_serde_processor(config)
    try:
        layout = MemoryLayoutDesc(shapes=[torch.Size([2, 4, 256, 128])], dtypes=[torch.bfloat16])
        codec = ChunkCodec.from_config({"preset": preset, **{k: v for k, v in config.kwargs.items() if k == "seed"}})
        assert processor.estimate_serialized_size(layout) == codec.payload_size(layout.shapes, layout.dtypes)
    finally:
        processor.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_workers": 0}, "max_workers must be an integer >= 1"),
        ({"presett": "kvpolicy-4bit"}, r"unknown serde key 'presett'.*did you mean 'preset'"),
        ({"preset": "kvpolicy-4.5bit"}, "groups of 64 tokens"),
    ],
)
def test_bad_serde_entries_are_refused_naming_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        create(kwargs)


def test_a_type_named_after_a_preset_fixes_it():
    with pytest.raises(ConfigError, match="serde type 'kvpolicy-3bit' fixes the preset"):
        create({"preset": "kvpolicy-4bit"}, "kvpolicy-3bit")


def test_serializer_and_deserializer_on_memory_objects():
    """What LMCache hands them: the chunk's groups, and a byte buffer of the estimated size."""
    x = [chunk(2, 256, 2, 64), torch.randn(1, 2, 256, 32).to(torch.bfloat16)]
    codec = ChunkCodec()
    ser, de = KVPolicySerializer(codec), KVPolicyDeserializer(codec)
    size = ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[g.shape for g in x], dtypes=[g.dtype for g in x]))
    buf = torch.empty(size, dtype=torch.uint8)
    assert ser.serialize(Obj(*x), Obj(buf), key()) == size
    out = [torch.zeros_like(g) for g in x]
    de.deserialize(Obj(buf), Obj(*out), key())
    assert torch.equal(out[1], x[1]) and (out[0].float() - x[0].float()).norm() / x[0].float().norm() < 0.35


def test_the_launcher_is_lmcaches_command_line():
    proc = subprocess.run([sys.executable, "-m", "kvpolicy_lmcache", "--help"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "server" in proc.stdout
