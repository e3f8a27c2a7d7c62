"""What every command shares about the machine: its torch thread count and the one record of
the environment that goes into each JSON next to the timings."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata

import psutil
import torch

__all__ = ["positive_int", "add_threads_argument", "add_quiet_argument", "torch_threads", "progress", "cpu_model", "load_average",
           "package_version", "git_commit", "environment"]

GiB = 1024**3


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


def add_quiet_argument(parser, summary: str = "summary line on stdout") -> None:
    """Add ``--quiet``, the same in every command: no progress output on stderr and no ``summary``;
    errors and a failed check are still shown."""
    parser.add_argument("--quiet", action="store_true",
                        help=f"no progress output and no {summary} (errors and failed checks are still shown)")


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


def load_saved(path, map_location="cpu"):
    """``torch.load(path, weights_only=True)``: tensors and plain containers only, torch's warnings silenced
    while it reads. Raises ``ValueError`` with why, in one line: a file that names a class the safe loader
    refuses (torch's "Unsupported global") holds objects other than tensors (never with torch's advice to load
    it with ``weights_only=False``, which runs the file's code); anything else is not a file ``torch.save``
    wrote whole (the kind of exception torch raised)."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch.load raises many kinds (UnpicklingError, KeyError, RuntimeError, EOFError)
        if "Unsupported global" in str(exc):
            raise ValueError("it holds objects other than tensors and plain containers, which are never loaded") from None
        raise ValueError(f"not a whole file written by torch.save ({type(exc).__name__})") from None


@contextlib.contextmanager
def quiet_transformers(quiet: bool = True):
    """With ``quiet``: transformers' log below errors and its progress bars off inside the block, both as
    they were after it; without, nothing changes."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as tf_logging

    level, bars = tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)
        if bars:
            tf_logging.enable_progress_bar()


def read_pretrained(path: str, option: str, architectures, command: str, quiet: bool = False) -> torch.nn.Module:
    """A Hugging Face ``save_pretrained`` folder read offline (``local_files_only``), SDPA attention, no KV
    cache, eval mode; its architecture (``config.architectures[0]``) one of ``architectures`` (class names
    of ``transformers``); ``quiet``: transformers silent while it reads (:func:`quiet_transformers`).
    Raises ``ValueError`` naming ``option`` and ``path`` for a config or weights it cannot read and another
    architecture (naming what ``command`` reads)."""
    import transformers as tf

    with quiet_transformers(quiet):
        try:
            c = tf.AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{option} {path}: cannot read its config: {str(exc).splitlines()[0]}") from None
        arch = (getattr(c, "architectures", None) or [None])[0]
        if arch not in architectures:
            raise ValueError(f"{option} {path}: architecture {arch!r}; {command} reads {', '.join(architectures)}")
        c._attn_implementation = "sdpa"
        c.use_cache = False
        try:
            return getattr(tf, arch).from_pretrained(path, config=c, local_files_only=True).eval()
        except (OSError, ValueError) as exc:
            raise ValueError(f"{option} {path}: cannot read its weights: {str(exc).splitlines()[0]}") from None


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


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages now; ``None`` where the platform has none."""
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``; ``None`` when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The short commit of the checkout this code runs from (``+dirty`` with uncommitted changes
    to tracked files); ``None`` outside a git checkout or without git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        if rev.returncode:
            return None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: str = "cpu") -> dict:
    """The record of the machine and software a command runs on, the same in every command's JSON
    (``environment``; bench's ``env`` and each bench job's). Take it when the work starts, inside
    :func:`torch_threads`: ``threads`` is torch's intra-op thread count in this process then, and
    ``memory_available_gib_at_start`` and ``load_average_at_start`` (1, 5, 15 min; ``None`` where
    the platform has none) are measured then; a command adds what it measures later
    (``load_average_at_end``). Keys: ``date`` (UTC, ISO 8601), ``python``, ``platform``, ``torch``,
    ``numpy``, ``blockhess_commit`` (:func:`git_commit`), ``threads``, ``interop_threads``,
    ``cpu_model``, ``logical_cpus``, ``physical_cpus``, ``memory_total_gib``,
    ``memory_available_gib_at_start``, ``load_average_at_start``, ``cuda``: for a ``device`` of type
    ``cuda``, the GPU's name, the CUDA version and whether TF32 matmuls are on; else ``None``.
    """
    vm = psutil.virtual_memory()
    cuda = None
    if torch.device(device).type == "cuda":
        from blockhess.validation import tf32_enabled

        cuda = {"device": torch.cuda.get_device_name(torch.device(device)), "version": torch.version.cuda,
                "tf32": tf32_enabled()}
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": str(torch.__version__),
        "numpy": package_version("numpy"),
        "blockhess_commit": git_commit(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cpus": psutil.cpu_count(logical=False),
        "memory_total_gib": round(vm.total / GiB, 2),
        "memory_available_gib_at_start": round(vm.available / GiB, 2),
        "load_average_at_start": load_average(),
        "cuda": cuda,
    }
