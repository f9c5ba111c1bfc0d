"""The one header check of a versioned JSON document (plans, bundles, profiles, clusters, metrics, sidecars).

Every document Confidant writes for itself carries a `format` name and a version number; a reader
refuses a document of another kind or of a version it does not read, with one line naming the file
and what to do. Written once here so that every reader says it the same way (it was written seven
times, with four error types and four wordings).
"""
from __future__ import annotations

from typing import Any, Mapping

from .errors import InputFileError


class HeaderError(InputFileError):
    """A JSON document that is not the kind or version its reader expects (a bad input: exit status 2)."""


def check_header(doc: Any, *, format: str | None, versions: int | tuple[int, ...] | None, where: str,
                 version_key: str = "schema_version", redo: str | None = None,
                 error: type[Exception] = HeaderError) -> int | None:
    """The version of `doc`, after checking it is a JSON object of `format` (None: no format field) whose
    integer `version_key` is one of `versions` (None: any or none, for the side files of an export, which
    were only ever told apart by their format). Otherwise raise `error` (a caller maps to its own type
    this way) with one line: `where` names the document (a path, "plan out: plan.json"), `redo` says how
    to get a document this build reads."""
    then = f"; {redo}" if redo else ""
    if not isinstance(doc, Mapping):
        raise error(f"{where} is a JSON {type(doc).__name__}, not an object{then}")
    if format is not None and doc.get("format") != format:
        raise error(f"{where} is not a {format} document (its format is {doc.get('format')!r}){then}")
    version = doc.get(version_key)
    if versions is None:
        return version
    reads = (versions,) if isinstance(versions, int) else tuple(versions)
    if not isinstance(version, int) or isinstance(version, bool):
        raise error(f"{where} has no integer {version_key} (got {version!r}){then}")
    if version not in reads:
        raise error(f"{where}: {version_key} {version} is not supported by this build "
                    f"(reads {', '.join(map(str, reads))}){then}")
    return version
