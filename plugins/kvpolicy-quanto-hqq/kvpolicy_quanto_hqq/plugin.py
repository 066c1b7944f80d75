"""The entry point (``[project.entry-points."kvpolicy"] quanto-hqq = "kvpolicy_quanto_hqq.plugin"``).

kvpolicy imports this module on its first registry lookup and calls the hook below. The backends are named by
module, so neither backend module, nor optimum-quanto, nor hqq is imported before a cache uses that backend.
"""

from __future__ import annotations

from kvpolicy.hookspecs import hookimpl


@hookimpl
def kvpolicy_register_backends() -> dict[str, object]:
    return {
        "quanto": "kvpolicy_quanto_hqq.quanto_backend:QuantoBackend",
        "hqq": "kvpolicy_quanto_hqq.hqq_backend:HQQBackend",
    }
