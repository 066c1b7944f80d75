"""pluggy hook specifications: the one extension surface for policies, actions, backends, transforms,
presets, quantized tensor formats, saved-file codecs, subcommands of the ``kvpolicy`` command and model presets.

The built-in parts register through these same hooks (:mod:`kvpolicy.builtins`); third-party
distributions implement them in the module an entry point of the group ``kvpolicy`` names
(loaded by :mod:`kvpolicy.registry`; see docs/how-to/write-a-plugin.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("kvpolicy")
hookimpl = pluggy.HookimplMarker("kvpolicy")


@hookspec
def kvpolicy_register_policies() -> dict[str, type]:
    """Return ``{name: Policy subclass}`` (or ``"module:Class"``, imported at its first lookup; so for every
    kind of part)."""


@hookspec
def kvpolicy_register_actions() -> dict[str, type]:
    """Return ``{name: Action subclass}``."""


@hookspec
def kvpolicy_register_backends() -> dict[str, type]:
    """Return ``{name: Backend subclass}``."""


@hookspec
def kvpolicy_register_transforms() -> dict[str, type]:
    """Return ``{name: Transform subclass}`` (an orthogonal change of basis of demoted tokens)."""


@hookspec
def kvpolicy_register_presets() -> dict[str, object]:
    """Return ``{name: preset function returning CompressedCache keyword arguments}``."""


@hookspec
def kvpolicy_register_formats() -> dict[str, type]:
    """Return ``{name: Format subclass}`` (a quantized tensor format, :mod:`kvpolicy.formats`; the name is
    the ``scheme`` that selects it in ``Quantize``)."""


@hookspec
def kvpolicy_register_codecs() -> dict[str, type]:
    """Return ``{name: Codec subclass}`` (how a saved cache's tensors are coded, :class:`kvpolicy.persist.Codec`;
    the name selects it in ``cache.save(path, codec=name)`` and is recorded in the file)."""


@hookspec
def kvpolicy_register_commands() -> dict[str, Callable[[argparse._SubParsersAction], None]]:
    """Return ``{name: register}``: subcommands of the ``kvpolicy`` command line. ``register(subparsers)``
    adds the subcommand's parser and sets its ``func`` (see :mod:`kvpolicy.commands`); the
    ``kvpolicy-lab`` distribution adds its commands (``ablate``, ``tune``, ...) this way."""


@hookspec
def kvpolicy_register_model_presets() -> dict[str, object]:
    """Return ``{name: kvpolicy.model_presets.ModelPreset}``: preset files inside the plugin's own package, each
    with the models it suits (config ``model_type``, optional config fields) and the measurement behind it.
    Declarative data, checked when the plugins load; ``CompressedCache.for_model(model, "auto")``,
    :func:`kvpolicy.model_presets.suggest` and ``kvpolicy presets --for MODEL`` use them."""


def command(module: str) -> Callable[[argparse._SubParsersAction], None]:
    """``register(subparsers)`` for :func:`kvpolicy_register_commands` that imports ``module`` (which defines
    its own ``register``) only when the parser is built: a lookup of a policy never imports a command."""

    def register(sub: argparse._SubParsersAction) -> None:
        import importlib

        importlib.import_module(module).register(sub)

    register.__qualname__ = register.__name__ = f"register_{module.rpartition('.')[2]}"
    return register
