"""``python -m blockhess``: the same command line as the ``blockhess`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
