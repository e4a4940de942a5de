"""The ``hookbench`` command line.

    hookbench report    verify the hook mechanisms on the installed torch; exit 1 on a failure
"""

from __future__ import annotations

import argparse
import sys

from hookbench import report


def _report(args: argparse.Namespace) -> int:
    sections = [report.contract_section(), report.optimizer_in_backward_section()]
    print(report.render(sections))
    return 0 if all(s.ok for s in sections) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hookbench",
        description="Regression and verification suite for the PyTorch hooks behind "
                    "memory-saving training.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "report", help="verify the hook mechanisms on the installed torch and print a table",
    ).set_defaults(run=_report)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
