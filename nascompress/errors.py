"""User-facing errors. The CLI prints their message as one line and exits non-zero."""
from __future__ import annotations


class NascompressError(Exception):
    """A problem with the user's input: the message says what is wrong and what to do."""
