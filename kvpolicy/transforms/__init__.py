"""Transforms: an orthogonal change of basis of demoted tokens, between the policy and the action.

``"none"`` (:class:`NoTransform`, the default) and ``"hadamard"`` (:class:`Hadamard`) are built in;
plugins register more through the ``kvpolicy_register_transforms`` hook (docs/how-to/write-a-plugin.md).
"""

from kvpolicy.transforms.base import NoTransform, Transform
from kvpolicy.transforms.hadamard import Hadamard
from kvpolicy.transforms.store import TransformedStore, wrap

__all__ = ["Hadamard", "NoTransform", "Transform", "TransformedStore", "wrap"]
