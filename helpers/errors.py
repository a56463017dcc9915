"""Errors shared by the readers and the CLIs.

``BadInput`` is what every reader raises when a file or a field cannot be used. Its message always
names the file (and the field, when there is one) and says what was expected, so that a CLI can print
it as its one-line reason and exit with code 2 (DESIGN.md, "CLI").
"""
from __future__ import annotations

from pathlib import Path


class BadInput(ValueError):
    """An input the diagnosis cannot use (missing, truncated, wrong shape, unsafe payload, ...).

    Args:
        message: what is wrong and what was expected.
        path: the file concerned, if any (prefixed to the message).
        field: the field / key / tensor name concerned, if any.
    """

    def __init__(self, message: str, *, path: str | Path | None = None, field: str | None = None):
        self.path = None if path is None else str(path)
        self.field = field
        where = ""
        if self.path is not None:
            where = self.path
            if field:
                where += f" [{field}]"
            where += ": "
        elif field:
            where = f"[{field}]: "
        super().__init__(f"{where}{message}")


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (newlines folded), for a CLI's stderr."""
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())
