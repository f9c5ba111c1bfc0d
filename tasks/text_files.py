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
