"""Transforms: an orthogonal change of basis of demoted tokens, between the policy and the action.

``"none"`` (:class:`NoTransform`, the default) and ``"hadamard"`` (:class:`Hadamard`) are built in; plugins
register more through the ``kvpolicy_register_transforms`` hook, each binding its per-layer state as a
:class:`Basis` (docs/how-to/write-a-plugin.md).
"""

from kvpolicy.transforms.base import Basis, BindContext, NoTransform, Transform
from kvpolicy.transforms.hadamard import Hadamard

__all__ = ["Basis", "BindContext", "Hadamard", "NoTransform", "Transform"]
