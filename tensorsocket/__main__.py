"""``python -m tensorsocket``: the ``tensorsocket`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
