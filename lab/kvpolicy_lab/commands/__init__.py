"""The lab's subcommands of the ``kvpolicy`` command line, one module each (``register(subparsers)``,
as in :mod:`kvpolicy.commands`), registered by :mod:`kvpolicy_lab.plugin`."""
