"""``python -m tfdp.train CONFIG ...``: the same as ``tfdp train CONFIG ...``."""

import sys

from tfdp.train.cli import cli_main

if __name__ == "__main__":
    sys.exit(cli_main())
