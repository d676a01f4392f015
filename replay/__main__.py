"""``python -m replay``: the ``replay`` command (``replay.cli.main``), for an environment whose scripts
folder is not on ``PATH``."""

import sys

from replay.cli import main

if __name__ == "__main__":
    sys.exit(main())
