"""The one error type the demo reports to its user as a single line with exit code 2."""

from __future__ import annotations

__all__ = ["DemoError"]


class DemoError(Exception):
    """A problem with the demo's input or environment: a bad file, device or directory.

    The command line prints ``normhooks demo: error: <message>`` and exits with status 2, so
    the message must name the option and say what is wrong, in one line.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
