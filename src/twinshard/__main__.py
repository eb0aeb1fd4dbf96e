"""``python -m twinshard ...`` and ``torchrun ... -m twinshard ...``: the ``twinshard`` command."""

import sys

from twinshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
