"""The one error type users see."""


class YggError(Exception):
    """An error the user can fix; the CLI prints its message as one line and exits non-zero."""
