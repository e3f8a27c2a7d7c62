"""What every command shares about the machine: its torch thread count and a record of
the environment that goes into each JSON next to the timings."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import time

import torch

__all__ = ["positive_int", "add_threads_argument", "torch_threads", "progress", "cpu_model", "environment"]


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (else argparse's usage error, exit status 2)."""
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def add_threads_argument(parser, default: int = 1) -> None:
    """Add ``--threads N`` (torch intra-op threads while the command runs; an integer >= 1)."""
    parser.add_argument(
        "--threads", type=positive_int, default=default, metavar="N",
        help=f"torch CPU threads while the command runs (default: {default}; the matrices per step are small, "
             "and on cores shared with other processes more threads oversubscribe them and run slower)",
    )


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the body with ``torch.set_num_threads(n)``, restoring the previous count afterwards.

    Raises ``ValueError`` for ``n < 1``.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"--threads must be an integer >= 1, got {n!r}")
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)



def progress(iterable=None, quiet: bool = False, **kw):
    """A tqdm progress bar on stderr: off with ``quiet``, and off by itself when stderr is not a
    terminal (logs and pipes get no carriage-return lines)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=True if quiet else None, leave=False, dynamic_ncols=True, file=sys.stderr, **kw)

def cpu_model() -> str:
    """The CPU model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    """Torch and Python versions, threads in use, CPU model and count, load average, date."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "torch": str(torch.__version__), "python": platform.python_version(), "threads": torch.get_num_threads(),
        "cpu": cpu_model(), "cpus": os.cpu_count(), "load_average": list(load) if load else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
