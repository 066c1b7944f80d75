"""Optional third-party packages behind a backend: imported when the backend is constructed."""

from __future__ import annotations

import importlib
from types import ModuleType

from kvpolicy.errors import ConfigError, MissingDependencyError


def require(module: str, backend: str, extra: str) -> ModuleType:
    """Import ``module`` for ``backend`` or raise :class:`MissingDependencyError` naming the extra.

    Parameters
    ----------
    module : str
        Dotted module name (``"optimum.quanto"``).
    backend : str
        The backend's registered name, used in the message.
    extra : str
        The kvpolicy extra that installs the package (``pip install "kvpolicy[<extra>]"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"backend {backend!r} needs the package providing {module!r}, which is not installed "
            f'({exc}); install it with: pip install "kvpolicy[{extra}]"'
        ) from exc


def refuse_fitted_ranges(backend: str, fmt: object, role: str = "") -> None:
    """Raise :class:`ConfigError` if ``fmt`` fits its ranges (``fit`` other than ``"minmax"``): a backend whose
    library chooses every group's range itself cannot store them."""
    fit = getattr(fmt, "fit", "minmax")
    if fit != "minmax":
        param = f"{role}_fit" if role else "fit"
        raise ConfigError(
            f"backend {backend!r} does not fit min-max ranges with {param}={fit!r}; it supports fit in ['minmax'] "
            f"(fit='mse': backends 'torch', 'cpu' and 'triton'). Pass {param}='minmax' to use backend {backend!r}"
        )
