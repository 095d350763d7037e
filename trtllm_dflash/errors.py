"""User-facing errors: one sentence saying what is wrong and what to do."""


class DFlashError(Exception):
    """An error caused by the user's input; the CLI prints it without a traceback."""
