"""What a job raises when the user can fix the cause (a flag, a file, a plan): printed as one line,
without a traceback, by the command line."""


class JobError(Exception):
    """An error the user can fix; the message names the cause and, where there is one, the fix."""
