"""``blockhess`` command line: one subcommand per module of :mod:`blockhess_lab`.

It needs the ``lab`` extra (``pip install 'blockhess[lab]'``: matplotlib, scikit-learn, SciPy,
tqdm); without it every invocation but ``blockhess --version``, ``--help`` included, prints one
line naming what is missing and how to install it, and exits with status 2, before anything else
is imported. ``blockhess --version`` needs only :mod:`importlib.metadata` and works without it.

Every command writes JSON (and figures) into ``--out``. Exit status: 0 on success; 2 for the
user's mistakes, with one line ``blockhess <command>: error: <reason>`` on stderr (no usage
block: ``blockhess <command> --help`` shows it): an argument argparse refuses, a ``ValueError`` (bad input, a missing or unusable checkpoint, and
:class:`~blockhess.validation.InsufficientMemoryError`: a problem too large for this machine's
memory) or an ``OSError`` (an ``--out`` that cannot be written, a full disk); 1 when a command's
own check fails (``validate`` above ``--tol``, ``bounds`` with a violated bound: results are written
first); 130 on Ctrl-C. Anything else is a bug and shows its traceback (exit 1). ``python -m
blockhess`` is the same command line (:mod:`blockhess.__main__`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import sys

# import name -> distribution: what the lab extra adds to the library's torch, numpy and psutil
LAB_REQUIRES = {"matplotlib": "matplotlib", "sklearn": "scikit-learn", "scipy": "scipy", "tqdm": "tqdm"}

# subcommand -> module in blockhess_lab (HELP, add_arguments, run)
COMMANDS = {
    "report": "report",
    "bounds": "bounds",
    "scaling": "scaling",
    "convergence": "convergence",
    "distributed": "distributed",
    "validate": "validate",
    "bench": "bench",
    "spectrum": "spectrum",
    "compare": "compare",
}


def _version() -> str:
    try:
        return importlib.metadata.version("blockhess")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "(not installed)"


def missing_lab_requirements() -> list[str]:
    """The distributions of :data:`LAB_REQUIRES` that cannot be imported here (none when the
    ``lab`` extra is installed)."""
    return [dist for name, dist in LAB_REQUIRES.items() if importlib.util.find_spec(name) is None]


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``<prog>: error: <message>`` on stderr and
    exit status 2, without the usage block; its subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version_line() -> str:
    return f"blockhess {_version()}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="blockhess",
        description="Exact closed-form Hessians of Transformer blocks (arXiv 2510.16927).",
    )
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"blockhess_lab.{module}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP, epilog=getattr(mod, "DETAILS", None))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else list(argv)) == ["--version"]:  # without the lab extra too
        print(_version_line())
        return 0
    missing = missing_lab_requirements()
    if missing:
        print(f"blockhess: the command line needs the 'lab' extra, and {', '.join(missing)} "
              f"{'is' if len(missing) == 1 else 'are'} not installed: pip install 'blockhess[lab]' "
              "(from a checkout: pip install -e '.[lab]'); the library itself (import blockhess) needs only torch, "
              "numpy and psutil", file=sys.stderr)
        return 2
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # named by the subcommand's parser, not the top-level one
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args._run(args) or 0)
    except (ValueError, OSError) as exc:  # the user's input or machine; any other exception is a bug: traceback
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"blockhess {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"blockhess {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
