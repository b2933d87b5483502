"""`python -m pagedmla ...`: the `pagedmla` command line."""

import sys

from pagedmla.cli import main

if __name__ == "__main__":
    sys.exit(main())
