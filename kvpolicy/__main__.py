"""``python -m kvpolicy``: the ``kvpolicy`` command (:mod:`kvpolicy.cli`)."""

import sys

from kvpolicy.cli import main

if __name__ == "__main__":
    sys.exit(main())
