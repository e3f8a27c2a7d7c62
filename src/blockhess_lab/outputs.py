"""Writing a command's results: all or nothing, and never over someone else's folder.

Every command builds its results in a temporary folder next to ``--out`` and moves it
into place only when everything is written, so an error never leaves a partial report.
A results folder carries a marker file (``MARKER``); an existing ``--out`` is replaced only
if it has one (a previous run's results) or is empty, so a mistyped ``--out`` cannot
delete a folder of other files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["atomic_dir", "check_out", "out_help", "write_json", "MARKER"]

MARKER = ".blockhess-results"


def out_help(default: str, holds: str = "") -> str:
    """The ``--out`` help of a command writing through :func:`atomic_dir`."""
    return (f"output folder{': ' + holds if holds else ''}, written when all is done; an existing folder is replaced "
            f"only if it holds a previous run's results or is empty (default: {default})")


def _probe(folder: Path, out: Path) -> None:
    """Raise ``OSError`` (one line, naming ``--out``) unless a folder can be made in ``folder``."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".blockhess-probe-", dir=folder))
    except OSError as exc:
        raise OSError(f"cannot write to --out {out}: {exc.strerror or exc}") from None


def check_out(out: str | os.PathLike) -> None:
    """Raise ``OSError`` (one line) unless ``out`` may be written and replaced by :func:`atomic_dir`
    (or written into, as ``bench`` does): absent, with its nearest existing parent a folder in
    which a folder can be made (the missing parents are made when the results are written), or
    an existing writable folder, empty or with :data:`MARKER`, and not the current folder or one
    above it. Every command calls it before any work, so a bad ``--out`` fails at once."""
    out = Path(out).resolve()
    if not out.exists():
        parent = out.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise OSError(f"cannot write to --out {out}: {parent} is not a folder")
        _probe(parent, out)
        return
    if not out.is_dir():
        raise OSError(f"--out {out} exists and is not a folder")
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise OSError(f"--out {out} is the current folder or one above it; give a folder of its own for the results")
    if any(out.iterdir()) and not (out / MARKER).exists():
        raise OSError(f"--out {out} exists and holds files that are not blockhess results (no {MARKER} in it): "
                      "it is left alone; give a new or empty "
                      "folder, or remove this one")
    _probe(out, out)
    _probe(out.parent, out)


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike):
    """Yield a fresh temporary folder; on success it replaces ``out`` (an existing ``out``
    is removed only after the new one is complete) with the permissions of a folder made by
    ``mkdir`` (``0777`` less the umask), not the temporary folder's ``0700``, and the
    :data:`MARKER` file that lets a later run replace it.

    Raises ``OSError`` with a one-line reason, before any work, if the parent of ``out``
    cannot be written, or ``out`` exists and is not a folder, is the current folder or one
    above it, or holds files without :data:`MARKER` (not a previous run's results).
    """
    out = Path(out).resolve()
    parent = out.parent
    check_out(out)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as exc:
        raise OSError(f"cannot write to --out {out}: {exc.strerror or exc}") from None
    try:
        yield tmp
        (tmp / MARKER).write_text("results of a blockhess command; the next run with this --out replaces this folder\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the results are an ordinary folder
        old = None
        if out.exists():
            check_out(out)  # again: the folder may have changed during the run
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.replace(out, old / out.name)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: str | os.PathLike, data) -> None:
    """``data`` as indented JSON (floats as written by :mod:`json`; NaN/Inf are refused)."""
    Path(path).write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
