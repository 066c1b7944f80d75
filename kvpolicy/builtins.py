"""The built-in parts, registered through the same hooks as third-party plugins (each class named by its
module, imported at its first lookup)."""

from __future__ import annotations

from kvpolicy.hookspecs import command, hookimpl


@hookimpl
def kvpolicy_register_policies() -> dict[str, object]:
    return {
        "log": "kvpolicy.policies.log:LogWindow", "recent": "kvpolicy.policies.recent:RecentWindow",
        "sink": "kvpolicy.policies.sink:SinkWindow", "h2o": "kvpolicy.policies.h2o:HeavyHitters",
        "sinks": "kvpolicy.policies.sinks:Sinks",
    }  # fmt: skip


@hookimpl
def kvpolicy_register_actions() -> dict[str, object]:
    return {
        "quantize": "kvpolicy.actions.quantize:Quantize", "evict": "kvpolicy.actions.evict:Evict",
        "none": "kvpolicy.actions.none:NoCompression", "tiered": "kvpolicy.actions.tiered:Tiered",
    }  # fmt: skip


@hookimpl
def kvpolicy_register_backends() -> dict[str, object]:
    return {
        "torch": "kvpolicy.backends.torch_backend:TorchBackend",
        "triton": "kvpolicy.backends.triton_backend:TritonBackend",
        "cpu": "kvpolicy.backends.cpu_backend:CpuBackend",
    }


@hookimpl
def kvpolicy_register_transforms() -> dict[str, object]:
    return {
        "none": "kvpolicy.transforms.base:NoTransform", "hadamard": "kvpolicy.transforms.hadamard:Hadamard",
    }  # fmt: skip


#: the built-in presets: name -> the function of :mod:`kvpolicy.presets` building its composition
PRESETS = {
    "logquant": "logquant", "logquant-4bit": "logquant_4bit", "kivi": "kivi", "h2o": "h2o",
    "streamingllm": "streamingllm", "kvpolicy-3bit": "kvpolicy_3bit", "kvpolicy-3.5bit": "kvpolicy_3_5bit",
    "kvpolicy-4bit": "kvpolicy_4bit", "kvpolicy-4.5bit": "kvpolicy_4_5bit",
}  # fmt: skip


@hookimpl
def kvpolicy_register_presets() -> dict[str, object]:
    return {name: f"kvpolicy.presets:{function}" for name, function in PRESETS.items()}


@hookimpl
def kvpolicy_register_formats() -> dict[str, object]:
    return {
        "minmax": "kvpolicy.formats.packed:MinMax", "codebook": "kvpolicy.formats.codebook:Codebook",
    }  # fmt: skip


#: the core's subcommands (the kvpolicy-lab distribution registers its own through the same hook)
CORE_COMMANDS = ("list", "plugins", "presets")


@hookimpl
def kvpolicy_register_commands() -> dict[str, object]:
    return {name: command(f"kvpolicy.commands.{name}") for name in CORE_COMMANDS}
