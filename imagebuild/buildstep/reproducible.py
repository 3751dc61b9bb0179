"""What makes a stage's tools deterministic, in one place (docs/build.md, Reproducibility).

1. **The RUN environment.** BuildKit passes the ``SOURCE_DATE_EPOCH`` build arg only to the image
   config's times; a RUN step sees it only when its stage declares ``ARG SOURCE_DATE_EPOCH``. The
   Dockerfile each stage is built from is the definition's with that one line added after every
   ``FROM`` (``dockerfile_for_build``). The value is the stage's epoch (from the lock's source
   commit times, else 1980-01-01), already part of the stage key, so it moves no key from one
   build to the next. An ARG is in each RUN's environment and never in the image's config
   (``docker run`` does not see it). With it:

   - ``py_compile`` (so ``compileall``, pip's byte-compilation and Debian's ``py3compile``) writes
     checked-hash ``.pyc`` files: a hash of the source, not its install-time mtime;
   - the ``wheel`` builder (setuptools' ``bdist_wheel``) gives every zip entry that time;
   - every other tool of the reproducible-builds convention (gzip's headers, man pages, ...).

2. **Records of when a tool ran** (``RECORDS_OF_WHEN``): files whose only content beyond the
   packages they name is the wall-clock time of the run. ``layerclamp`` leaves them out of the
   stage's own layers (the path then keeps its parent's version, or none), as debuerreotype
   removes them from Debian's reproducible images. Exact paths, never a pattern: a new source of
   difference is a failing check that names the file (``reprodiff``), not something scrubbed.

No process is started here.
"""

from __future__ import annotations

import re

from imagebuild.definition import dockerfile

EPOCH_ARG = "SOURCE_DATE_EPOCH"

# path in the image -> why it is left out of a stage's layers (docs/build.md lists the same)
RECORDS_OF_WHEN: dict[str, str] = {
    "var/log/dpkg.log": "dpkg's log: a wall-clock time on every line",
    "var/log/alternatives.log": "update-alternatives' log: a wall-clock time on every line",
    "var/log/apt/history.log": "apt's log: Start-Date and End-Date of each run",
    "var/log/apt/term.log": "apt's terminal log: Log started/ended times",
    "var/log/apt/eipp.log.xz": "apt's planner log: the run's time",
    "var/cache/ldconfig/aux-cache": "ldconfig's cache of the libraries' inode numbers and ctimes (rebuilt when missing)",
    "var/cache/debconf/config.dat-old": "debconf's backup of the previous run's state",
    "var/cache/debconf/templates.dat-old": "debconf's backup of the previous run's state",
    "var/cache/debconf/passwords.dat-old": "debconf's backup of the previous run's state",
    "var/lib/dpkg/status-old": "dpkg's backup of the previous run's state",
    "var/lib/dpkg/available-old": "dpkg's backup of the previous run's state",
    "var/lib/dpkg/diversions-old": "dpkg's backup of the previous run's state",
    "var/lib/dpkg/statoverride-old": "dpkg's backup of the previous run's state",
}

DROPPED = frozenset(RECORDS_OF_WHEN)

_ESCAPE_RE = re.compile(r"#\s*escape\s*=\s*(\S)", re.I)
_DIRECTIVE_RE = re.compile(r"#\s*[A-Za-z_]+\s*=")


def normalized(name: str) -> str:
    """A tar member's name as a path in the image: no leading ``./`` or ``/``."""
    while name.startswith(("./", "/")):
        name = name[2:] if name.startswith("./") else name[1:]
    return name


def _escape_char(lines: list[str]) -> str:
    for ln in lines:
        s = ln.strip()
        if not _DIRECTIVE_RE.match(s):
            break
        m = _ESCAPE_RE.match(s)
        if m:
            return m.group(1)
    return "\\"


# Under emulation of linux/arm64 every RUN gets an AArch64 /proc/cpuinfo (core/emulation.py): the process
# otherwise reads the x86 host's, and torch's oneDNN (xbyak_aarch64) dies at import ("Can't open MIDR_EL1
# sysfs entry", then a segmentation fault), which stops glm53's torch stage at its own `import torch`. A bind
# mount leaves nothing in the layer; runc allows it on /proc/cpuinfo (as LXCFS uses it).
CPUINFO_CONTEXT = "imagebuild-cpuinfo"
CPUINFO_MOUNT = f"--mount=type=bind,from={CPUINFO_CONTEXT},source=cpuinfo,target=/proc/cpuinfo"
_RUN_RE = re.compile(r"^(\s*)(run)(\s+)", re.I)


def dockerfile_for_build(text: str, *, cpuinfo: bool = False) -> str:
    """The Dockerfile as BuildKit gets it: ``text`` with ``ARG SOURCE_DATE_EPOCH`` after every
    ``FROM`` instruction (after its last line when it continues over several); with ``cpuinfo``, every
    RUN also mounts the emulated platform's /proc/cpuinfo (on its first line: no line moves). Nothing
    else changes: later instructions move down one line per FROM before them (the build's log names
    the file as built)."""
    lines = text.splitlines(keepends=True)
    if cpuinfo:
        for ins in dockerfile.parse(text).instructions:
            if ins.keyword == "RUN":
                i = ins.line - 1
                lines[i] = _RUN_RE.sub(lambda m: f"{m.group(1)}{m.group(2)} {CPUINFO_MOUNT}{m.group(3)}", lines[i],
                                       count=1)
    esc = _escape_char(lines)
    after: set[int] = set()  # 0-based index of the line after which the ARG goes
    for f in dockerfile.parse(text).froms:
        i = f.line - 1
        while i + 1 < len(lines) and lines[i].rstrip("\r\n").rstrip().endswith(esc):
            i += 1
        after.add(i)
    out: list[str] = []
    for i, ln in enumerate(lines):
        out.append(ln)
        if i in after:
            if not ln.endswith("\n"):
                out[-1] += "\n"
            out.append(f"ARG {EPOCH_ARG}\n")
    return "".join(out)
