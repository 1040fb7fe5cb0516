"""`python -m enforcer` is the same as the `vram-enforcer` command."""

import sys

from enforcer.cli import main

sys.exit(main())
