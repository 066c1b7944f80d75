"""Exceptions raised by kvpolicy. Every message names the parameter, the value and what is allowed."""

from __future__ import annotations


class ConfigError(ValueError):
    """A parameter has a value that the composition (policy, action, backend, layout) cannot accept."""


class NonFiniteError(ValueError):
    """NaN or Inf reached the quantizer; quantizing it would spread garbage through a whole group."""
