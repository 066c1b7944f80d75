"""The entry point ``research-transforms = "kvpolicy_research.transforms_plugin"``.

kvpolicy imports this module on its first registry lookup and calls the hook below; the transforms'
modules are imported only when it runs.
"""

from __future__ import annotations

from kvpolicy.hookspecs import hookimpl


@hookimpl
def kvpolicy_register_transforms() -> dict[str, type]:
    from kvpolicy_research.calibrated import CalibratedRotation
    from kvpolicy_research.lowrank import LowRank
    from kvpolicy_research.query_weighted import QueryWeighted

    return {"lowrank": LowRank, "query-hadamard": QueryWeighted, "calibrated-hadamard": CalibratedRotation}
