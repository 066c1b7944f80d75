"""Backends: how quantized bits are packed and unpacked."""

from kvpolicy.backends.base import Backend, Capabilities, QTensor
from kvpolicy.backends.torch_backend import TorchBackend

__all__ = ["Backend", "Capabilities", "QTensor", "TorchBackend"]
