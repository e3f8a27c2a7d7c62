"""Writing a command's results: all or nothing.

Every command builds its results in a temporary folder next to ``--out`` and moves it
into place only when everything is written, so an error never leaves a partial report.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["atomic_dir", "write_json"]


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike):
    """Yield a fresh temporary folder; on success it replaces ``out`` (an existing ``out``
    is removed only after the new one is complete) with the permissions of a folder made by
    ``mkdir`` (``0777`` less the umask), not the temporary folder's ``0700``.

    Raises ``OSError`` with a one-line reason if the parent of ``out`` cannot be written
    (checked before any work) or ``out`` exists and is not a folder.
    """
    out = Path(out).resolve()
    parent = out.parent
    if out.exists() and not out.is_dir():
        raise OSError(f"--out {out} exists and is not a folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as exc:
        raise OSError(f"cannot write to --out {out}: {exc.strerror or exc}") from None
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the results are an ordinary folder
        old = None
        if out.exists():
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
