"""Subcommands of the ``kvpolicy`` command line, one module each.

Each module defines ``register(subparsers)``: it adds its parser and sets ``func`` (taking the
parsed ``argparse.Namespace`` and returning an exit code).
"""
