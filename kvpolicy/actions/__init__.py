"""Actions: what happens to the tokens a policy demotes."""

from kvpolicy.actions.base import Action, DemotedStore
from kvpolicy.actions.evict import Evict
from kvpolicy.actions.none import NoCompression
from kvpolicy.actions.quantize import Quantize

__all__ = ["Action", "DemotedStore", "Evict", "NoCompression", "Quantize"]
