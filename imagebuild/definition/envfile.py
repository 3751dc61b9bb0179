"""Strict reader and in-place writer for ``versions.env``.

The file must be valid for ``source`` in bash *and* mean the same thing without a shell: no
expansion, no command substitution, no escapes. Accepted lines:

    # a comment
    KEY=value            # unquoted: no whitespace, quotes, $ ` \\ ; & | < > ( )
    KEY="two words"      # double quotes: no $ ` \\ " inside
    KEY='anything but a single quote'
    KEY=                 # empty value

Anything else is a problem reported with file and line; all problems are collected. So are bytes
bash would read differently: a NUL byte, a carriage return (a CRLF line ending makes bash read
``$'1.2.0\r'``), other control characters, text that is not UTF-8, and a ``KEY=value`` longer
than one command-line argument may be (Linux: 131072 bytes), since every pin ends up as one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from imagebuild.core import lazy
from imagebuild.core.errors import DefinitionError, Problem, excerpt
from imagebuild.core.fsutil import atomic_write_text
from imagebuild.definition.textfile import TextError, decode

KEY_RE = lazy.compile(r"[A-Z_][A-Z0-9_]*\Z")
# Linux's MAX_ARG_STRLEN (32 pages of 4 KiB): the longest single command-line argument, NUL included.
# A pin reaches docker as one argument (--build-arg KEY=value), git or a label: longer ones fail with
# "Argument list too long" in the middle of a build.
MAX_ARG_STRLEN = 131072
_UNQUOTED_BAD = set(" \t\"'$`\\;&|<>(){}*?[]~")
_DQ_BAD = set('$`\\"')


@dataclass(frozen=True)
class Entry:
    key: str
    value: str
    line: int


@dataclass
class EnvFile:
    path: Path
    display: str  # how errors name the file (relative to the project root)
    entries: dict[str, Entry] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    broken: set[str] = field(default_factory=set)  # keys whose line had a problem

    def get(self, key: str, default: str | None = None) -> str | None:
        e = self.entries.get(key)
        return e.value if e else default

    def line_of(self, key: str) -> int | None:
        e = self.entries.get(key)
        return e.line if e else None

    def values(self) -> dict[str, str]:
        return {k: e.value for k, e in self.entries.items()}

    def with_updates(self, updates: dict[str, str]) -> str:
        """The file's text with ``updates`` applied in place (comments, order and layout kept).

        Keys not present are appended at the end. Values are validated and quoted as needed.
        """
        new_lines = list(self.lines)
        for key, value in updates.items():
            rendered = f"{key}={quote(value)}"
            entry = self.entries.get(key)
            if entry is None:
                if new_lines and new_lines[-1].strip():
                    new_lines.append("")
                new_lines.append(rendered)
                continue
            old = new_lines[entry.line - 1]
            comment = _trailing_comment(old)
            new_lines[entry.line - 1] = rendered + (f"  {comment}" if comment else "")
        return "\n".join(new_lines) + "\n"

    def update(self, updates: dict[str, str]) -> None:
        """Rewrite the file atomically with ``updates`` applied in place."""
        atomic_write_text(self.path, self.with_updates(updates))


def quote(value: str) -> str:
    """Render a value so that bash and this parser read the same string."""
    if value and not (set(value) & _UNQUOTED_BAD) and "#" not in value[:1]:
        return value
    if not (set(value) & _DQ_BAD) and "\n" not in value:
        return f'"{value}"'
    if "'" not in value and "\n" not in value:
        return f"'{value}'"
    raise ValueError(f"value cannot be written safely to versions.env: {value!r}")


def _trailing_comment(line: str) -> str | None:
    try:
        _, _, rest = _split_value(line.split("=", 1)[1])
    except (IndexError, ValueError):
        return None
    rest = rest.strip()
    return rest if rest.startswith("#") else None


def _split_value(raw: str) -> tuple[str, str, str]:
    """Split the text after ``=`` into (value, quoting, rest). Raises ValueError with a reason."""
    if raw.startswith('"'):
        end = raw.find('"', 1)
        if end < 0:
            raise ValueError('unterminated double quote (expected a closing ")')
        value = raw[1:end]
        bad = sorted(set(value) & _DQ_BAD)
        if bad:
            raise ValueError(
                f"character(s) {' '.join(bad)} inside double quotes would be expanded by bash; "
                "use single quotes or remove them"
            )
        return value, '"', raw[end + 1 :]
    if raw.startswith("'"):
        end = raw.find("'", 1)
        if end < 0:
            raise ValueError("unterminated single quote (expected a closing ')")
        return raw[1:end], "'", raw[end + 1 :]
    m = re.match(r"[^\s]*", raw)
    value = m.group(0) if m else ""
    bad = sorted(set(value) & _UNQUOTED_BAD)
    if bad:
        raise ValueError(
            f"unquoted value contains {' '.join(repr(c) for c in bad)}, which bash would interpret; "
            "quote the value (\"...\") or remove them"
        )
    return value, "", raw[len(value) :]


def split_lines(text: str) -> list[str]:
    """Lines as bash sees them: split at ``\n`` only (``str.splitlines`` also splits at ``\r``,
    form feeds and Unicode separators, which would shift every line number after them)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _control_characters(line: str) -> list[str]:
    if line.isprintable() or line.replace("\t", " ").isprintable():
        return []  # printable text has none of them (the usual line: one C call, no loop)
    return [ch for ch in line if (ord(ch) < 32 and ch != "\t") or ord(ch) == 0x7F or ch in "\x85\u2028\u2029"]


def _check_bytes(lines: list[str], display: str, problems: list[Problem]) -> list[str]:
    """Report NUL, carriage returns and other control characters by line; return the lines without
    them, so that the rest of the file is still checked (and no follow-up problem is invented)."""
    crlf = [n for n, line in enumerate(lines, start=1) if line.endswith("\r")]
    if crlf:
        more = f" (and {len(crlf) - 1} more line{'s' if len(crlf) > 2 else ''})" if len(crlf) > 1 else ""
        pins = [lines[n - 1].rstrip("\r") for n in crlf if "=" in lines[n - 1] and
                not lines[n - 1].lstrip().startswith("#")]
        shown = pins[0].split("=", 1)[1].split(" ", 1)[0] if pins else ""
        problems.append(Problem(
            display, f"CRLF line ending{more}: bash keeps the carriage return in the value" +
            (f" (it reads $'{shown}\\r', not '{shown}')" if pins else ""), line=crlf[0],
            hint="save the file with Unix line endings (LF), e.g. sed -i 's/\\r$//' versions.env"))
    out = []
    for n, line in enumerate(lines, start=1):
        body = line[:-1] if line.endswith("\r") else line
        bad = _control_characters(body)
        if "\x00" in bad:
            problems.append(Problem(display, "a NUL byte (\\x00): bash drops it, so the value would not be "
                                    "what this file says", line=n, hint="remove it"))
        elif "\r" in bad:
            problems.append(Problem(display, "a carriage return (\\r) inside the line: bash keeps it in the "
                                    "value", line=n, hint="remove it"))
        elif bad:
            problems.append(Problem(display, f"control character {bad[0]!r} in the line: a pin is plain "
                                    "printable text", line=n, hint="remove it"))
        out.append("".join(ch for ch in body if ch not in bad) if bad else body)
    return out


def parse_text(text: str, path: Path, display: str, problems: list[Problem]) -> EnvFile:
    """Parse ``text``; append every problem found to ``problems``."""
    env = EnvFile(path=path, display=display, lines=split_lines(text))
    for lineno, line in enumerate(_check_bytes(env.lines, display, problems), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if "=" not in line:
            problems.append(Problem(display, f"expected KEY=VALUE, got {excerpt(stripped)}", line=lineno,
                                    hint="every non-comment line assigns one pin, e.g. VLLM_REF=<40-hex sha>"))
            continue
        key, raw = line.split("=", 1)
        if key != key.strip() or raw[:1].isspace():
            problems.append(Problem(display, "spaces around '=' are not valid in bash", line=lineno,
                                    key=key.strip(), hint="write KEY=VALUE with nothing around '='"))
            continue
        if key.startswith("export "):
            problems.append(Problem(display, "'export' is not allowed; versions.env holds plain assignments",
                                    line=lineno, key=key[7:].strip()))
            continue
        if not KEY_RE.match(key):
            problems.append(Problem(display, f"invalid key {key!r} (expected UPPER_CASE letters, digits, _)",
                                    line=lineno, key=key))
            continue
        try:
            value, _, rest = _split_value(raw)
        except ValueError as exc:
            problems.append(Problem(display, str(exc), line=lineno, key=key))
            env.broken.add(key)
            continue
        rest_stripped = rest.strip()
        if rest_stripped and not (rest[:1].isspace() and rest_stripped.startswith("#")):
            env.broken.add(key)
            problems.append(Problem(display, f"unexpected text after the value: {rest_stripped[:40]!r}",
                                    line=lineno, key=key,
                                    hint="quote values that contain spaces; comments need a space before '#'"))
            continue
        size = len(f"{key}={value}".encode()) + 1
        if size > MAX_ARG_STRLEN:
            env.broken.add(key)
            problems.append(Problem(
                display, f"KEY=value is {size} bytes: longer than one command-line argument may be "
                f"({MAX_ARG_STRLEN} bytes on Linux, MAX_ARG_STRLEN); the build would fail with 'Argument "
                "list too long' when it passes it to docker (--build-arg KEY=value)", line=lineno, key=key,
                hint="a pin is short: put long content in a file the stage lists under 'files:'"))
            continue
        if key in env.entries:
            first = env.entries[key].line
            problems.append(Problem(display, f"duplicate key (first set on line {first})", line=lineno, key=key,
                                    hint="every pin is set exactly once"))
            continue
        env.entries[key] = Entry(key, value, lineno)
    return env


def load(path: Path, display: str) -> EnvFile:
    """Read and parse ``path``; raise DefinitionError listing every problem."""
    problems: list[Problem] = []
    try:
        text = decode(path.read_bytes())
    except TextError as exc:
        raise DefinitionError([Problem(display, exc.message, line=exc.line)]) from None
    except OSError as exc:
        raise DefinitionError([Problem(display, f"cannot read: {exc.strerror}")]) from None
    env = parse_text(text, path, display, problems)
    if problems:
        raise DefinitionError(problems)
    return env
