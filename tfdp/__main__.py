"""``python -m tfdp``: the same as the ``tfdp`` console script."""

import sys

from tfdp.cli import main

if __name__ == "__main__":
    sys.exit(main())
