"""The built-in parts, registered through the same hooks as third-party plugins."""

from __future__ import annotations

from kvpolicy.hookspecs import command, hookimpl


@hookimpl
def kvpolicy_register_policies() -> dict[str, type]:
    from kvpolicy.policies.h2o import HeavyHitters
    from kvpolicy.policies.log import LogWindow
    from kvpolicy.policies.recent import RecentWindow
    from kvpolicy.policies.sink import SinkWindow
    from kvpolicy.policies.sinks import Sinks

    return {"log": LogWindow, "recent": RecentWindow, "sink": SinkWindow, "h2o": HeavyHitters, "sinks": Sinks}


@hookimpl
def kvpolicy_register_actions() -> dict[str, type]:
    from kvpolicy.actions.evict import Evict
    from kvpolicy.actions.none import NoCompression
    from kvpolicy.actions.quantize import Quantize
    from kvpolicy.actions.tiered import Tiered

    return {"quantize": Quantize, "evict": Evict, "none": NoCompression, "tiered": Tiered}


@hookimpl
def kvpolicy_register_backends() -> dict[str, type]:
    from kvpolicy.backends.cpu_backend import CpuBackend
    from kvpolicy.backends.hqq_backend import HQQBackend
    from kvpolicy.backends.quanto_backend import QuantoBackend
    from kvpolicy.backends.torch_backend import TorchBackend
    from kvpolicy.backends.triton_backend import TritonBackend

    return {
        "torch": TorchBackend,
        "triton": TritonBackend,
        "quanto": QuantoBackend,
        "hqq": HQQBackend,
        "cpu": CpuBackend,
    }


@hookimpl
def kvpolicy_register_transforms() -> dict[str, type]:
    from kvpolicy.transforms import Hadamard, NoTransform

    return {"none": NoTransform, "hadamard": Hadamard}


@hookimpl
def kvpolicy_register_presets() -> dict[str, object]:
    from kvpolicy import presets

    return dict(presets.BUILTIN_PRESETS)


@hookimpl
def kvpolicy_register_formats() -> dict[str, type]:
    from kvpolicy.formats import BUILTIN

    return dict(BUILTIN)


#: the core's subcommands (the kvpolicy-lab distribution registers its own through the same hook)
CORE_COMMANDS = ("list", "plugins", "estimate")


@hookimpl
def kvpolicy_register_commands() -> dict[str, object]:
    return {name: command(f"kvpolicy.commands.{name}") for name in CORE_COMMANDS}
