"""`python -m ddiloco.dashboard` is `ddiloco dashboard`."""

import sys

from ddiloco.dashboard.cli import main

if __name__ == "__main__":
    sys.exit(main())
