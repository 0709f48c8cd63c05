"""``python -m reshard``: the same command line as the ``reshard`` script."""

from __future__ import annotations

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
