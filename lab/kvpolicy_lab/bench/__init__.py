"""Benchmarks behind ``kvpolicy bench`` (one module per benchmark)."""
