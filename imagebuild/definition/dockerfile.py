"""Read the parts of a Dockerfile that planning needs: ARG, FROM and COPY/ADD, with line numbers.

Not a full parser: it joins continuation lines, skips comments and heredoc bodies, and splits
each instruction into its keyword and words. That is enough to know which build arguments a
stage declares, what it builds FROM, and which context files it copies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from imagebuild.core import lazy

_HEREDOC_RE = lazy.compile(r"<<-?\s*([\"']?)([A-Za-z_][A-Za-z0-9_]*)\1")
_VAR_RE = lazy.compile(r"^\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))$")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # the rest of the (joined) instruction
    line: int  # first line of the instruction


@dataclass(frozen=True)
class Arg:
    name: str
    default: str | None
    line: int
    global_scope: bool  # declared before the first FROM


@dataclass(frozen=True)
class From:
    image: str  # as written, e.g. ${PARENT} or builder
    alias: str | None
    line: int

    @property
    def variable(self) -> str | None:
        """The ARG the image comes from, when it is exactly ``$NAME`` or ``${NAME}``."""
        return variable(self.image)


def variable(text: str) -> str | None:
    """NAME when ``text`` is exactly ``$NAME`` or ``${NAME}``, else None."""
    m = _VAR_RE.match(text)
    return (m.group(1) or m.group(2)) if m else None


@dataclass(frozen=True)
class Copy:
    keyword: str  # COPY or ADD
    sources: tuple[str, ...]
    from_stage: str | None
    mounts: tuple[str, ...]
    line: int


@dataclass(frozen=True)
class Dockerfile:
    instructions: tuple[Instruction, ...]
    args: tuple[Arg, ...]
    froms: tuple[From, ...]
    copies: tuple[Copy, ...]
    syntax_directive: int | None  # line of a "# syntax=" directive, if any
    mount_froms: tuple[tuple[str, int], ...] = ()  # (from=, line) of each RUN --mount that has one

    def arg_names(self) -> list[str]:
        seen: list[str] = []
        for a in self.args:
            if a.name not in seen:
                seen.append(a.name)
        return seen

    def defaults(self) -> dict[str, str | None]:
        """ARG name -> default (None when no ARG declaration of it carries one)."""
        out: dict[str, str | None] = {}
        for a in self.args:
            if out.get(a.name) is None:
                out[a.name] = a.default
        return out


def parse(text: str) -> Dockerfile:
    """The instructions, ARGs, FROMs, COPYs and RUN mounts of ``text``."""
    lines = text.splitlines()
    instructions: list[Instruction] = []
    syntax_line = None
    i = 0
    seen_instruction = False
    while i < len(lines):
        raw = lines[i]
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            if not seen_instruction and re.match(r"#\s*syntax\s*=", stripped, re.I):
                syntax_line = i + 1
            i += 1
            continue
        seen_instruction = True
        start = i
        parts = [stripped]
        while parts[-1].endswith("\\") and i + 1 < len(lines):
            parts[-1] = parts[-1][:-1].rstrip()
            i += 1
            nxt = lines[i].strip()
            if nxt.startswith("#") or not nxt:
                # a comment (or blank line) inside a continuation is dropped; the instruction goes on
                parts.append("\\")
                continue
            parts.append(nxt)
        joined = " ".join(p for p in parts if p and p != "\\")
        i += 1
        for m in _HEREDOC_RE.finditer(joined):
            word = m.group(2)
            while i < len(lines) and lines[i].strip() != word:
                i += 1
            i += 1
        keyword, _, rest = joined.partition(" ")
        instructions.append(Instruction(keyword.upper(), rest.strip(), start + 1))

    args: list[Arg] = []
    froms: list[From] = []
    copies: list[Copy] = []
    mount_froms: list[tuple[str, int]] = []
    for ins in instructions:
        if ins.keyword == "ARG":
            for word in _split(ins.args):
                name, eq, default = word.partition("=")
                args.append(Arg(name, default if eq else None, ins.line, global_scope=not froms))
        elif ins.keyword == "FROM":
            words = [w for w in _split(ins.args) if not w.startswith("--")]
            image = words[0] if words else ""
            alias = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            froms.append(From(image, alias, ins.line))
        elif ins.keyword in ("COPY", "ADD"):
            words = _split(ins.args)
            flags = [w for w in words if w.startswith("--")]
            rest = [w for w in words if not w.startswith("--")]
            from_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            copies.append(Copy(ins.keyword, tuple(rest[:-1]), from_stage, (), ins.line))
        elif ins.keyword == "RUN":
            mount_froms += [(m["from"], ins.line) for m in run_mounts(ins) if "from" in m]
    return Dockerfile(tuple(instructions), tuple(args), tuple(froms), tuple(copies), syntax_line,
                      tuple(mount_froms))


def run_mounts(ins: Instruction) -> list[dict[str, str]]:
    """The ``--mount=...`` options of a RUN instruction, each as a dict."""
    out = []
    for w in _split(ins.args):
        if not w.startswith("--mount="):
            if not w.startswith("--"):
                break
            continue
        opts: dict[str, str] = {}
        for kv in w[len("--mount="):].split(","):
            k, _, v = kv.partition("=")
            opts[k] = v
        out.append(opts)
    return out


_SHLEX_SPECIAL = frozenset("\"'\\\x0b\x0c\x1c\x1d\x1e\x1f")


def _split(s: str) -> list[str]:
    if s.isascii() and _SHLEX_SPECIAL.isdisjoint(s):
        return s.split()  # what shlex gives for a line without quotes or escapes, ~20x faster
    import shlex

    try:
        return shlex.split(s, posix=True)
    except ValueError:
        return s.split()
