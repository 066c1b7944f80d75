"""Token-selection policies (pure logic over positions; no transformers import)."""

from kvpolicy.policies.base import Policy, PolicyState
from kvpolicy.policies.h2o import HeavyHitters
from kvpolicy.policies.log import LogWindow, log_full_positions
from kvpolicy.policies.recent import RecentWindow
from kvpolicy.policies.sink import SinkWindow
from kvpolicy.policies.sinks import Sinks

__all__ = [
    "HeavyHitters",
    "LogWindow",
    "Policy",
    "PolicyState",
    "RecentWindow",
    "SinkWindow",
    "Sinks",
    "log_full_positions",
]
