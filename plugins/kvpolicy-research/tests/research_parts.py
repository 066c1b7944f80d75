"""The research plugin's formats and codecs registered for a test module: the core's test set-up loads no
plugin by entry point (each test module that needs one registers it), as a third party's tests would."""

from __future__ import annotations

import pytest
from kvpolicy_research import formats_plugin

from kvpolicy import registry


def ensure_registered() -> None:
    """Register the plugin's formats and codecs unless the registry holds them already (a lookup first, so
    that an installed plugin loads by its entry point before this decides)."""
    if "lattice" not in registry.names("formats") and not registry.plugin_manager().is_registered(formats_plugin):
        registry.register(formats_plugin, "research-formats")


@pytest.fixture(autouse=True, scope="module")
def research_parts() -> None:
    """Autouse in the modules that import it: the parts are registered before any other fixture runs."""
    ensure_registered()
