"""``python -m twinshard.cli ...``: the ``twinshard`` command (as ``python -m twinshard``)."""

import sys

from twinshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
