"""The command line's error: something the user can fix, printed as one line without a traceback."""


class CliError(Exception):
    """An error the user can fix; printed as `confidant COMMAND: error: MESSAGE`, exit status 1
    (2 for a file that cannot be used: `ir.errors.InputFileError`, a missing file)."""


class UsageError(CliError):
    """A flag's value that cannot be used (checked past argparse): exit status 2, as argparse's own
    usage errors, so scripts tell a bad invocation from a failed run."""
