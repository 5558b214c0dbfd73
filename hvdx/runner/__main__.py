"""`python -m hvdx.runner ...`: the emulated cluster's command line (hvdx/runner/cli.py)."""
import sys

from .cli import main

sys.exit(main())
