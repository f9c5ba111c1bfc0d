"""What a job raises when the user can fix the cause (a flag, a file, a plan): printed as one line,
without a traceback, by the command line."""


class JobError(Exception):
    """An error the user can fix; the message names the cause and, where there is one, the fix."""


class FlagError(JobError):
    """Flags that cannot go together or a value out of range: a usage error (the command line exits 2)."""


class RunFailed(JobError):
    """A run that started and then could not go on (devices lost beyond recovery, `--on-failure
    stop`, a worker's error): `metrics` (jobs.common.metrics.TrainingMetrics) holds what it did, its steps
    and events, for the metrics document every exit path writes."""

    def __init__(self, message: str, metrics=None):
        super().__init__(message)
        self.metrics = metrics


class VersionMismatch(RunFailed):
    """A worker runs another Confidant than the coordinator (another protocol version, found at its
    setup): a setup the user fixes, as a bad input (the command line exits 2)."""


def failure_text(exc: BaseException) -> str:
    """What ended a run, for its metrics document's `error`: Ctrl-C as such, anything else by its
    kind and message."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    return f"{type(exc).__name__}: {exc}"
