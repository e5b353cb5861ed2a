"""`python -m sparkbook.cli`, as the `sparkbook` entry point."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
