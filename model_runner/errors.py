"""The runner's one error type: a one-line message naming what is wrong (the CLI prints it and exits with 2)."""


class RunnerError(ValueError):
    """A checkpoint, config, prompt or option the runner cannot use; the message names it on one line."""
