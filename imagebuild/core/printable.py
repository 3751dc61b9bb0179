"""Text fit for a terminal, a log file or a report: printable characters only.

Whatever imagebuild shows or writes that came from elsewhere (a build's output, a file's content, an
environment variable, a peer's answer, a principal's name) passes through ``printable``: terminal
escape sequences are taken out whole, then every character that is not printable is dropped, by
allow-list (``str.isprintable``, plus newline and tab), not by a list of known-bad sequences. So a
reset (``ESC c``), a character-set switch (``ESC ( 0``), a screen fill (``ESC # 8``), the 8-bit C1
controls (the CSI byte 0x9b, OSC 0x9d), a bell, a backspace, a carriage return or a bidi override
never reach a terminal (docs/security.md).
"""

from __future__ import annotations

from imagebuild.core import lazy

# taken out whole, so that no parameter bytes are left as text: CSI (7- and 8-bit), OSC, DCS/SOS/PM/APC
# strings (up to BEL or ST), and every other escape (ESC, intermediates 0x20-0x2f, a final byte)
_SEQUENCE = lazy.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[ -/]*[0-~]?")
_KEEP = frozenset("\n\t")


def printable(text: str, *, keep: frozenset[str] | str = _KEEP) -> str:
    """``text`` with escape sequences removed and only printable characters (and those in ``keep``:
    newline and tab unless told) left."""
    if text.isprintable():
        return text
    if "\x1b" in text or any("\x90" <= c <= "\x9f" for c in text):
        text = _SEQUENCE.sub("", text)
    return "".join(c for c in text if c.isprintable() or c in keep)


def one_line(text: str) -> str:
    """``printable`` on one line: newlines and tabs become spaces (a name, a value, a row's field)."""
    return printable(text.replace("\n", " ").replace("\t", " "))
