"""kvpolicy's formats as codecs for LMCache: importing this package registers them with LMCache's serde
registry (``"kvpolicy"``, ``"kvpolicy-3bit"``, ``"kvpolicy-3.5bit"``, ``"kvpolicy-4bit"``), so an L2
adapter's ``"serde": {"type": "kvpolicy", "preset": "kvpolicy-3bit"}`` selects one.

- :class:`~kvpolicy_lmcache.codec.ChunkCodec`: the codec itself (a chunk's groups to one payload and back);
- :mod:`kvpolicy_lmcache.serde`: LMCache's serializer and deserializer around it, and the registration;
- :mod:`kvpolicy_lmcache.payload`: the payload's bytes and the checks a reader makes;
- :mod:`kvpolicy_lmcache.launcher`: LMCache's command line with the codecs loaded (``kvpolicy-lmcache server ...``).
"""

from __future__ import annotations

from kvpolicy_lmcache.codec import ChunkCodec
from kvpolicy_lmcache.payload import PayloadError
from kvpolicy_lmcache.serde import register

register()

__version__ = "0.1.0"
__all__ = ["ChunkCodec", "PayloadError", "__version__", "register"]
