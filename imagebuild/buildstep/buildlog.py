"""What a failed stage's build log says, for ``build``'s own error and the nightly report
(docs/nightly.md, "When the nightly fails"): the failing step's own exit code (BuildKit's
``process "/bin/sh -c ..." did not complete successfully: exit code: N``; docker buildx itself
only exits 1), its command, where it is (``Dockerfile.check:4``), and the last lines of that
step's output, stripped of colour and redacted.

Read-only: it reads the log a build wrote (``<state>/builds/<image>/<run id>/logs/<stage>.log``).
"""

from __future__ import annotations

import re
from pathlib import Path

from imagebuild.core.printable import printable
from imagebuild.core.secrets import redact_text, secrets_in_env
from imagebuild.fetch.gitcache import redact as redact_url

TAIL_LINES = 20
MAX_LINE = 400  # characters kept of one log line
READ_BYTES = 4 << 20  # a stage log can be hundreds of MB: only its end is read

# the command is quoted with backslash escapes; in a JSON progress stream the quotes are escaped too
_STEP_EXIT = re.compile(r'process \\?"((?:[^"\\]|\\.)*?)\\?" did not complete successfully: exit code: (\d+)')
_TOOL_EXIT = re.compile(r"docker buildx build exit(?:ed)? (\d+)")
_VERTEX = re.compile(r"^#(\d+) ")
_ERROR_LINE = re.compile(r"^#(\d+) ERROR: ")
_OUTPUT = re.compile(r"^#\d+ \d+\.\d+ (.*)$")  # a step's own output line (the decoder's "#N <seconds> <text>")
_WHERE = re.compile(r"^(\S*Dockerfile\S*):(\d+)$")  # buildx's summary names the failing line


def run_exit(code: int | None) -> str:
    """A RUN step's exit code as every message shows it: ``RUN exit 3``, never a bare ``exit 3``
    that reads as imagebuild's own exit code (3: refused by a guard rail)."""
    return f"RUN exit {code}"


def clean(line: str) -> str:
    """One log line as a report shows it: no colour codes or control characters, no secret (the
    report's redaction and any ``user:password@`` of a URL), at most MAX_LINE characters."""
    text = printable(line, keep="\t")
    text = redact_url(redact_text(text, secrets_in_env()))
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 3] + "..."


def read_end(path: Path) -> str | None:
    """The last READ_BYTES of ``path`` as text; None when it cannot be read."""
    import os

    from imagebuild.core.fsutil import special_kind

    try:  # regular files only: a FIFO planted as a log would wait for a writer, /dev/zero never end
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            if special_kind(os.fstat(fd).st_mode) is not None:
                return None
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(size - READ_BYTES, 0))
            data = f.read(READ_BYTES)
    except OSError:
        return None
    text = data.decode("utf-8", "replace")
    if size > READ_BYTES:  # the first line is cut: drop it
        text = text.split("\n", 1)[-1]
    return text


def explain(text: str, n: int = TAIL_LINES) -> dict:
    """``{exit_code, command, tool_exit_code, tail, step, where, output}`` of a build log's text.

    ``exit_code`` and ``command``: the failing RUN step's (the last BuildKit ``did not complete
    successfully`` line), None when the log has none (the engine failed, a base image was missing).
    ``tool_exit_code``: docker buildx's own (imagebuild writes it as the log's last line).
    ``tail``: the failing step's last ``n`` lines (its header, output and error line), or the
    log's last ``n`` lines when no step is named as failing.
    ``step``: the failing step as BuildKit names it (``[2/3] RUN ...``); ``where``: its place
    (``Dockerfile.check:4``) from buildx's summary; ``output``: that step's own last ``n`` output
    lines, without BuildKit's ``#N <seconds>`` prefixes (None, None, [] when no step failed)."""
    lines = [ln for ln in (printable(x, keep="\t").rstrip() for x in text.splitlines())]
    exit_code = command = tool = None
    for m in _STEP_EXIT.finditer(text):
        command = printable(m.group(1).replace('\\"', '"').replace("\\\\", "\\"), keep="")
        exit_code = int(m.group(2))
    for m in _TOOL_EXIT.finditer(text):
        tool = int(m.group(1))
    vertex = None
    for ln in lines:
        m = _ERROR_LINE.match(ln)
        if m:
            vertex = m.group(1)
    step = where = None
    output: list[str] = []
    if vertex is not None:
        own = [ln for ln in lines if (m := _VERTEX.match(ln)) and m.group(1) == vertex]
        tail = own[-n:]
        if own and own[0] not in tail:  # keep the step's header (which RUN it was) first
            tail = [own[0], *own[-(n - 1):]]
        if own:
            step = own[0].split(" ", 1)[1] if " " in own[0] else None
        output = [m.group(1) for ln in own if (m := _OUTPUT.match(ln))][-n:]
        for ln in lines:
            if m := _WHERE.match(ln.strip()):
                where = f"{m.group(1)}:{m.group(2)}"
    else:
        tail = [ln for ln in lines if ln.strip()][-n:]
    return {"exit_code": exit_code, "command": clean(command) if command is not None else None,
            "tool_exit_code": tool, "tail": [clean(ln) for ln in tail],
            "step": clean(step) if step else None, "where": where, "output": [clean(ln) for ln in output]}


def explain_file(path: Path, n: int = TAIL_LINES) -> dict | None:
    text = read_end(path)
    return None if text is None else explain(text, n)
