"""``python -m hookbench.cli``, as it was before the command line became a folder: the same as
``python -m hookbench``."""

from __future__ import annotations

import sys

from hookbench.cli import main

if __name__ == "__main__":
    sys.exit(main())
