"""The codec in LMCache's serde interface (``lmcache.v1.distributed.serde``), and its registration.

:func:`register` adds a factory per name to LMCache's serde registry: ``"kvpolicy"`` (the preset named by
the ``"preset"`` key, ``"kvpolicy-3bit"`` by default) and one per preset served by name
(:data:`PRESET_TYPES`), so that an L2 adapter's JSON selects it::

    {"type": "fs", "base_path": "/cache", "serde": {"type": "kvpolicy", "preset": "kvpolicy-3bit"}}
    {"type": "resp", "host": "127.0.0.1", "port": 6379, "serde": {"type": "kvpolicy-4bit", "seed": 7}}

LMCache has no plugin loader for codecs: the module must be imported in the process that builds the
adapters (``import kvpolicy_lmcache``, or the ``kvpolicy-lmcache`` launcher for LMCache's server).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde import (
    AsyncSerdeProcessor,
    Deserializer,
    SerdeProcessor,
    Serializer,
    get_registered_serde_types,
    register_serde_factory,
)
from lmcache.v1.memory_management import MemoryObj

from kvpolicy.errors import ConfigError
from kvpolicy_lmcache.codec import ChunkCodec, GroupPlan

logger = init_logger(__name__)

#: the generic serde type (its ``"preset"`` key names the preset)
TYPE = "kvpolicy"
#: presets registered as serde types of their own name (``{"type": "kvpolicy-3bit"}``)
PRESET_TYPES = ("kvpolicy-3bit", "kvpolicy-3.5bit", "kvpolicy-4bit")


def _groups(obj: MemoryObj, what: str) -> list[torch.Tensor]:
    """The group tensors of a KV-shaped memory object, in layout order."""
    tensors = [obj.get_tensor(i) for i in range(len(obj.get_shapes()))]
    if any(t is None for t in tensors):
        raise ValueError(f"kvpolicy codec: the {what} memory object is invalid (no tensors)")
    return tensors  # type: ignore[return-value]


def _buffer(obj: MemoryObj, what: str) -> torch.Tensor:
    """The flat ``uint8`` bytes of a byte-buffer memory object."""
    t = obj.tensor
    if t is None:
        raise ValueError(f"kvpolicy codec: the {what} byte buffer is invalid (no tensor)")
    return t.reshape(-1).view(torch.uint8)


class TensorObj:
    """What the serializer and deserializer read of LMCache's ``MemoryObj``, over plain tensors: a chunk's
    group tensors, or one flat ``uint8`` byte buffer. For running them outside LMCache's memory manager
    (measurements, tests)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = list(tensors)

    @property
    def tensor(self) -> torch.Tensor:
        """The first (for a byte buffer: the only) tensor."""
        return self.tensors[0]

    def get_tensor(self, i: int) -> torch.Tensor:
        """Group ``i``'s tensor."""
        return self.tensors[i]

    def get_shapes(self) -> list[torch.Size]:
        """The groups' shapes."""
        return [t.shape for t in self.tensors]

    def get_dtypes(self) -> list[torch.dtype]:
        """The groups' dtypes."""
        return [t.dtype for t in self.tensors]


class _Plans:
    """Logs how each layout is stored, once per layout (which groups are coded, which kept verbatim)."""

    def __init__(self, codec: ChunkCodec) -> None:
        self.codec = codec
        self._seen: set = set()
        self._lock = threading.Lock()

    def note(self, shapes: list, dtypes: list) -> None:
        layout = (tuple(tuple(s) for s in shapes), tuple(dtypes))
        with self._lock:
            if layout in self._seen:
                return
            self._seen.add(layout)
        plan = self.codec.plan(shapes, dtypes)
        size = self.codec.payload_size(shapes, dtypes)
        logger.info("%r: layout %s -> %d-byte payloads; %s", self.codec, [list(s) for s in shapes], size,
                    "; ".join(_plan_line(i, g) for i, g in enumerate(plan)))  # fmt: skip


def _plan_line(i: int, g: GroupPlan) -> str:
    if g.mode == "raw":
        return f"group {i} stored verbatim ({g.why})"
    return f"group {i} coded (head_dim {g.head_dim})"


class KVPolicySerializer(Serializer):
    """LMCache serializer of :class:`ChunkCodec` payloads."""

    def __init__(self, codec: ChunkCodec) -> None:
        self.codec = codec
        self._plans = _Plans(codec)

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        """Write ``src``'s chunk into ``dst``'s bytes; returns the bytes written (the layout's
        :meth:`estimate_serialized_size`, exactly)."""
        self._plans.note(src.get_shapes(), src.get_dtypes())
        return self.codec.encode(_groups(src, "source"), _buffer(dst, "destination"), key)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """The exact payload size of a chunk of ``layout_desc`` (an upper bound that is always reached)."""
        return self.codec.payload_size(layout_desc.shapes, layout_desc.dtypes)


class KVPolicyDeserializer(Deserializer):
    """LMCache deserializer of :class:`ChunkCodec` payloads: fills the chunk or raises
    :class:`~kvpolicy_lmcache.payload.PayloadError` (LMCache then reports the load as failed)."""

    def __init__(self, codec: ChunkCodec) -> None:
        self.codec = codec

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        """Decode ``src``'s bytes into ``dst``'s groups, or refuse them before writing anything."""
        self.codec.decode(_buffer(src, "source"), _groups(dst, "destination"), key)


def create(config: dict[str, Any], preset: str | None = None) -> SerdeProcessor:
    """The serde processor an adapter's ``"serde"`` entry asks for (``preset``: the preset a type named
    after it fixes).

    Raises
    ------
    ConfigError
        A bad key or value (LMCache reports it when the adapter is built).
    """
    config = dict(config)
    if preset is not None:
        if config.get("preset", preset) != preset:
            raise ConfigError(
                f"kvpolicy codec: serde type {preset!r} fixes the preset; got preset={config['preset']!r} (use "
                f"type {TYPE!r} to name another)"
            )
        config["preset"] = preset
    workers = config.get("max_workers", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"kvpolicy codec: max_workers must be an integer >= 1; got max_workers={workers!r}")
    codec = ChunkCodec.from_config(config)
    return AsyncSerdeProcessor(KVPolicySerializer(codec), KVPolicyDeserializer(codec), max_workers=workers)


def register() -> None:
    """Register the serde types with LMCache (idempotent: a type already registered is left as it is)."""
    known = set(get_registered_serde_types())
    if TYPE not in known:
        register_serde_factory(TYPE, create)
    for name in PRESET_TYPES:
        if name not in known:
            register_serde_factory(name, lambda config, _name=name: create(config, _name))
