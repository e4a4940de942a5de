"""``hookbench`` and ``python -m hookbench``: the command line (``hookbench.cli``). A torch that
no longer has a module or name hookbench imports at load time (private ones move between
releases) gets one line naming it and exit code 1, a failure of that torch, not a traceback
(``hookbench.cli.main``); imports done later, inside a measurement, fail their own row."""

from __future__ import annotations

import sys

from hookbench.cli import main

if __name__ == "__main__":
    sys.exit(main())
