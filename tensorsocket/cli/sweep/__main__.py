"""``python -m tensorsocket.cli.sweep``: the same as ``tensorsocket sweep`` (and a wave's producer child)."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
