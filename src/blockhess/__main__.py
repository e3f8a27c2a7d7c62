"""``python -m blockhess``: the same command line as the ``blockhess`` console script.

The command line is the research harness's (:mod:`blockhess_lab.cli`, the ``lab`` extra);
only this entry point imports it, never ``import blockhess``.
"""

import sys

from blockhess_lab.cli import main

if __name__ == "__main__":
    sys.exit(main())
