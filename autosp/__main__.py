"""`python -m autosp ...` (the guard matters: ranks are spawned and re-import the main module)."""
import sys

from autosp.cli import main

if __name__ == "__main__":
    sys.exit(main())
