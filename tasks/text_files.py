"""A user's text file read as UTF-8 (a byte-order mark dropped), or one line naming it and the first
byte that is not UTF-8: the one reader the data and prediction inputs share."""
from __future__ import annotations

from pathlib import Path

from ir.errors import InputFileError


def read_utf8_text(path: str | Path, fix: str = "save it as UTF-8", label: str | None = None) -> str:
    """The text of `path`; `label` names it in the error (default: the path), `fix` says what to do."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{label or path}: not UTF-8 text ({exc.reason} at byte {exc.start}); {fix}") from None


def directory_given(path: str | Path, kind: str, label: str | None = None) -> IsADirectoryError:
    """The error for a folder given where a `kind` file was wanted: it names the files the folder
    does hold (a few), never a file that is not there."""
    path = Path(path)
    files = sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    where = f"{label} {path}" if label else str(path)
    if not files:
        return IsADirectoryError(f"{where} is a directory, and holds no files; give a {kind} file")
    shown = ", ".join(str(path / n) for n in files[:3]) + (f" or {len(files) - 3} more" if len(files) > 3 else "")
    return IsADirectoryError(f"{where} is a directory; give the {kind} file in it ({shown})")
