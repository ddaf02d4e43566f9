"""User-facing errors: the CLI prints their message as one line, never a traceback."""


class UserError(ValueError):
    """Bad input: the message names the field and the fix."""
