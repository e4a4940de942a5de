"""``hookbench`` and ``python -m hookbench``: the command line (``hookbench.cli``), loaded so
that a torch which no longer has a module or name hookbench imports at load time (private ones
move between releases) gets one line naming it and exit code 1, a failure of that torch, not a
traceback. Imports done later, inside a measurement, fail their own row instead."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from hookbench.cli import main as cli
    except ImportError as e:
        import torch

        print(f"hookbench: FAILED: cannot load hookbench on torch {torch.__version__}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
