"""LMCache's command line with kvpolicy's codecs registered: ``kvpolicy-lmcache <lmcache arguments>``.

LMCache builds its L2 adapters (and their serdes) inside the server process and has no plugin loader
for codecs, so the codec module must be imported there first. This launcher imports it and hands every
argument to LMCache's own ``lmcache`` command, unchanged::

    kvpolicy-lmcache server --l1-size-gb 4 --eviction-policy LRU \\
        --l2-adapter '{"type": "fs", "base_path": "/cache", "serde": {"type": "kvpolicy", "preset": "kvpolicy-3bit"}}'

``python -m kvpolicy_lmcache`` is the same command.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Register the codecs, then run LMCache's command line on ``argv`` (default: ``sys.argv[1:]``)."""
    from lmcache.cli.main import main as lmcache_main

    import kvpolicy_lmcache  # noqa: F401 - registers the serde types

    lmcache_main(sys.argv[1:] if argv is None else argv)
