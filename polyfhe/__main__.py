"""``python -m polyfhe``: the ``polyfhe`` command (what ``torchrun -m polyfhe train ...`` starts in each process)."""

import sys

from polyfhe.cli import main

if __name__ == "__main__":
    sys.exit(main())
