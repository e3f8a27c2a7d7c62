"""``blockhess`` command line: one subcommand per module of :mod:`blockhess.experiments`.

Every command writes JSON (and figures) into ``--out``; on bad input it prints one line
``blockhess <command>: error: <reason>`` to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

# subcommand -> module in blockhess.experiments (HELP, add_arguments, run)
COMMANDS = {
    "report": "report",
    "bounds": "bounds",
    "scaling": "scaling",
    "convergence": "convergence",
    "validate": "validate",
    "bench": "bench",
}


def _version() -> str:
    try:
        return importlib.metadata.version("blockhess")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blockhess",
        description="Exact closed-form Hessians of Transformer blocks (arXiv 2510.16927).",
    )
    parser.add_argument("--version", action="version", version=f"blockhess {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"blockhess.experiments.{module}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, OSError, RuntimeError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"blockhess {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
