"""`python -m edgespec ...`: the same command line as the `edgespec` script."""
import sys

from .cli import main

sys.exit(main())
