"""`python -m flashattn info | run ...`: the package's command line (flashattn/cli.py)."""
import sys

from .cli import main

sys.exit(main())
