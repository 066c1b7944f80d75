"""Token-selection policies (pure logic over positions; no transformers import)."""

from kvpolicy.policies.base import Policy, PolicyState
from kvpolicy.policies.log import LogWindow, log_full_positions

__all__ = ["LogWindow", "Policy", "PolicyState", "log_full_positions"]
