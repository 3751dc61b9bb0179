"""Decode a definition's text files (versions.env, image.yaml, Dockerfiles, patches) as UTF-8,
saying on which line and column a file is not UTF-8 rather than only that it is not."""

from __future__ import annotations


class TextError(ValueError):
    def __init__(self, message: str, line: int, column: int):
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column


def decode(data: bytes) -> str:
    """``data`` as UTF-8 text; raise TextError naming the line and column of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise TextError(f"not valid UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}, column {column})",
                        line, column) from None


# no definition text file is read past this (model.DEFINITION_MAX_BYTES says why)
MAX_BYTES = 8 << 20


def unreadable_kind(path) -> str | None:
    """Why ``path`` must not be read as a text file, or None: ``'a FIFO'`` (a read would hang until
    someone writes), ``'a socket'``, ``'a device'`` (a read may never end); a missing path is None
    (its reader says "not found")."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
        return "a device"
    return None
