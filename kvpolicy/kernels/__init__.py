"""Hand-written compute kernels used by backends.

Importing this package imports nothing heavy; each kernel module imports its own toolkit (Triton
...) and is imported only by the backend that needs it.
"""
