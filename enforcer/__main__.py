"""`python -m enforcer` is the same as the `vram-enforcer` command."""

import sys

from enforcer.cli import main

if __name__ == "__main__":
    sys.exit(main())
