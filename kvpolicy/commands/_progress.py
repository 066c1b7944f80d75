"""A progress bar for commands whose run may be long: it appears on stderr once the run has taken more than a
second (a quicker run prints nothing), only on a terminal, and names what is being worked on."""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

#: seconds before the bar appears
DELAY = 1.0


class Progress:
    """A bar over ``total`` steps that appears after :data:`DELAY` seconds.

    Parameters
    ----------
    total : int or None
        Steps in the run (``None``: unknown).
    desc : str
        What the run does (``"estimating"``).
    enabled : bool
        ``False`` for ``--no-progress``.
    file : file, optional
        Where the bar goes (default: stderr); nothing is shown unless it is a terminal.
    """

    def __init__(self, total: int | None, desc: str, enabled: bool = True, file: TextIO | None = None) -> None:
        self._file = file if file is not None else sys.stderr
        self._total, self._desc = total, desc
        self._done, self._what = 0, ""
        self._bar: Any = None
        self._closed = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        isatty = getattr(self._file, "isatty", None)
        if enabled and callable(isatty) and isatty():
            self._timer = threading.Timer(DELAY, self._show)
            self._timer.daemon = True
            self._timer.start()

    def working_on(self, what: str) -> None:
        """Say what the run works on now (shown beside the bar)."""
        with self._lock:
            self._what = what
            if self._bar is not None:
                self._bar.set_postfix_str(what, refresh=True)

    def advance(self) -> None:
        """One step done."""
        with self._lock:
            self._done += 1
            if self._bar is not None:
                self._bar.update()

    def close(self) -> None:
        """End the run: the bar (if shown) is cleared, and a bar not yet shown never will be."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._bar is not None:
                self._bar.close()

    def _show(self) -> None:
        """The timer's call: draw the bar, unless the run has ended."""
        from tqdm.auto import tqdm

        with self._lock:
            if self._closed or self._bar is not None:
                return
            self._bar = tqdm(total=self._total, initial=self._done, desc=self._desc, file=self._file, leave=False,
                             dynamic_ncols=True)  # fmt: skip
            if self._what:
                self._bar.set_postfix_str(self._what, refresh=True)
