"""``kvpolicy estimate --plot``: bytes held against prompt length, one line per cache, on log axes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpolicy.errors import ConfigError

#: how to install matplotlib (a dependency of kvpolicy-lab: missing only from a broken install)
EXTRA = "pip install matplotlib"
#: the image formats offered (matplotlib's, by suffix)
FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp")


def check_plot_file(path: Path) -> None:
    """Refuse, before any work, a plot that cannot be drawn or written.

    Raises
    ------
    ConfigError
        matplotlib is not installed (naming how to install it), the suffix is not an image format, or the file's
        directory does not exist or the path is a directory.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(f"--plot needs matplotlib, which is not installed: {EXTRA}") from None
    if path.suffix.lower() not in FORMATS:
        raise ConfigError(f"--plot {str(path)!r}: the file must end in one of {', '.join(FORMATS)}")
    if path.is_dir():
        raise ConfigError(f"--plot {str(path)!r} is a directory; give an image file path such as bytes.png")
    if not path.absolute().parent.is_dir():
        raise ConfigError(f"--plot {str(path)!r}: its directory {str(path.absolute().parent)!r} does not exist")


def lengths(longest: int) -> list[int]:
    """The prompt lengths drawn: powers of two from 256 up to the step, then multiples of it doubling
    until one reaches ``longest`` (cheap: the estimates past three search steps extend the exact ones)."""
    from kvpolicy_lab.capacity import STEP

    out = [n for n in (1 << k for k in range(8, 14)) if n < STEP]
    k = 1
    while True:
        out.append(k * STEP)
        if k * STEP >= longest:
            return out
        k *= 2


def plot_bytes(curves: dict[str, Any], path: Path, longest: int, budget: int | None, title: str) -> None:
    """Draw ``curves`` (name -> :class:`~kvpolicy_lab.capacity.Curve`) from 256 tokens to about ``longest``, with
    the ``budget`` line when given, into ``path``.

    Raises
    ------
    ConfigError
        The image cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvpolicy.memory import _human
    from kvpolicy_lab.capacity import STEP

    xs = lengths(longest)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, curve in curves.items():
        ys = [curve.held(n) if n % STEP else curve.at_step(n // STEP) for n in xs]
        style = {"color": "black", "linestyle": "--", "linewidth": 2} if curve.dynamic else {"marker": "o", "ms": 3}
        ax.plot(xs, [y / 2**30 for y in ys], label=name, **style)
    if budget is not None:
        ax.axhline(budget / 2**30, color="red", linewidth=1, label=f"budget ({_human(budget)})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("KV cache held (GiB)")
    ax.set_title(f"KV cache bytes after a prompt: {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise ConfigError(f"--plot {str(path)!r} cannot be written: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
