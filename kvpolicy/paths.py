"""Where kvpolicy keeps files it fetches or builds (the reference model, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """The user cache directory of kvpolicy.

    Returns
    -------
    Path
        ``$KVPOLICY_CACHE_DIR`` if set, else ``platformdirs.user_cache_dir("kvpolicy")``
        (``~/.cache/kvpolicy`` on Linux).
    """
    env = os.environ.get("KVPOLICY_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("kvpolicy"))
