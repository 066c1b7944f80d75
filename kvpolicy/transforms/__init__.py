"""Transforms: an orthogonal change of basis of demoted tokens, between the policy and the action.

``"none"`` (:class:`NoTransform`, the default), ``"hadamard"`` (:class:`Hadamard`), ``"query-hadamard"``
(:class:`QueryWeighted`: keys weighted per channel by the queries, then rotated) and ``"lowrank"``
(:class:`LowRank`: each key's principal-direction part held beside the codes, the residual rotated) are
built in; plugins register more through the ``kvpolicy_register_transforms`` hook
(docs/how-to/write-a-plugin.md).
"""

from kvpolicy.transforms.base import Basis, NoTransform, Transform
from kvpolicy.transforms.hadamard import Hadamard
from kvpolicy.transforms.lowrank import LowRank
from kvpolicy.transforms.query_weighted import QueryWeighted

__all__ = ["Basis", "Hadamard", "LowRank", "NoTransform", "QueryWeighted", "Transform"]
