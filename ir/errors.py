"""The one error kind that crosses every layer: a file the user gave that cannot be used.

Raised by the ONNX lowering (a damaged, foreign or unsupported model file), the data readers (a
CoNLL or TSV file with a bad line) and anything else that reads a user's file. The message names
the file, where in it the problem is (a node, a line) and what to do about it. The command line
prints it as one line and exits with status 2, the status of every bad-input error (argparse's
usage errors included), so scripts can tell a bad input from a failed run (status 1).
"""
from __future__ import annotations


class InputFileError(ValueError):
    """A user's file cannot be used; the message says which file, where in it, and what to do."""
