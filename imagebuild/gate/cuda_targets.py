"""Which CUDA code a file carries (from ``cuobjdump``'s listing) and the arch rule it must meet.

A CUDA ELF (a ``.so`` with a fatbin) embeds device code per target: SASS for one GPU
architecture (``sm_121a``, ``sm_120f``, ``sm_90``) and PTX that the driver compiles at load time
(``compute_121a``). ``cuobjdump FILE`` prints one header per embedded image, ``Fatbin elf code:``
(SASS) or ``Fatbin ptx code:`` (PTX), each followed by ``arch = sm_XXX``; with
``--dump-resource-usage`` the SASS headers are followed by one ``Function NAME:`` line per kernel.
cuobjdump exits 255 with "does not contain device code" for an ELF without a fatbin.

The rule (the gate's ``cuda-targets`` kind, docs/gate.md): every CUDA ELF carries SASS for at least
one allowed target, and nothing but allowed or tolerated targets (tolerated ones never count as a
file's own); each required target is carried by some file;
each kernel pattern matches a kernel of some file. Pure: no I/O, so unit tests feed it real listings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SASS_RE = re.compile(r"sm_[0-9]{2,3}[af]?\Z")
PTX_RE = re.compile(r"compute_[0-9]{2,3}[af]?\Z")
FRAME = "@@imagebuild-cuda-file "   # the check's shell loop prints it before each file's listing
RC = "@@imagebuild-cuda-rc "        # ... and its exit code after it
NO_DEVICE_CODE = 255                # cuobjdump's exit code for an ELF without device code

_ARCH = re.compile(r"^arch = (sm_[0-9]+[af]?)\s*$")
_FUNC = re.compile(r"^\s*Function (\S+?):\s*$")


@dataclass
class Fatbin:
    """What one file embeds."""
    sass: set[str] = field(default_factory=set)
    ptx: set[str] = field(default_factory=set)     # as compute_XXX
    kernels: set[str] = field(default_factory=set)  # mangled names of its SASS functions


@dataclass
class Scan:
    """The listing of every file under the checked path."""
    cuda: dict[str, Fatbin] = field(default_factory=dict)    # path -> its device code
    plain: list[str] = field(default_factory=list)           # ELFs without device code
    unreadable: dict[str, str] = field(default_factory=dict)  # path -> cuobjdump's message


def parse_listing(text: str) -> Fatbin:
    """One file's ``cuobjdump [--dump-resource-usage]`` output."""
    fb = Fatbin()
    section, arch = None, None
    for line in text.splitlines():
        s = line.strip()
        if s == "Fatbin elf code:":
            section, arch = "sass", None
        elif s == "Fatbin ptx code:":
            section, arch = "ptx", None
        elif (m := _ARCH.match(s)) and section:
            arch = m.group(1)
            if section == "sass":
                fb.sass.add(arch)
            else:
                fb.ptx.add("compute_" + arch[3:])
        elif (m := _FUNC.match(line)) and section == "sass" and arch:
            fb.kernels.add(m.group(1))
    return fb


def parse_scan(stdout: str) -> Scan:
    """The framed output of the check's loop: ``FRAME path``, the listing, ``RC n``, per file."""
    scan = Scan()
    path, body = None, []
    for line in stdout.splitlines():
        if line.startswith(FRAME):
            path, body = line[len(FRAME):], []
        elif line.startswith(RC) and path is not None:
            rc = int(line[len(RC):].strip() or "1")
            text = "\n".join(body)
            if rc == 0:
                scan.cuda[path] = parse_listing(text)
            elif rc == NO_DEVICE_CODE or "does not contain device code" in text:
                scan.plain.append(path)
            else:
                msg = next((ln.strip() for ln in reversed(body) if ln.strip()), f"exit {rc}")
                scan.unreadable[path] = msg[:200]
            path, body = None, []
        elif path is not None:
            body.append(line)
    return scan


def judge(scan: Scan, *, sass: list[str], ptx: list[str], require: list[str], kernels: list[str],
          min_files: int, tolerate: list[str] = ()) -> tuple[bool, str]:
    """(passed, one-line detail) of the rule on ``scan``."""
    files = sorted(scan.cuda)
    found_sass = sorted({t for f in files for t in scan.cuda[f].sass})
    found_ptx = sorted({t for f in files for t in scan.cuda[f].ptx})
    summary = (f"{len(files)} CUDA ELF(s), {len(scan.plain)} without device code; "
               f"SASS {', '.join(found_sass) or 'none'}; PTX {', '.join(found_ptx) or 'none'}")
    problems: list[str] = []
    if scan.unreadable:
        path, msg = sorted(scan.unreadable.items())[0]
        problems.append(f"cuobjdump cannot read {len(scan.unreadable)} file(s), e.g. {path}: {msg}")
    if len(files) < min_files:
        problems.append(f"found {len(files)} CUDA ELF(s), expected at least {min_files}")
    unexpected: dict[str, list[str]] = {}
    no_sass: list[str] = []
    for f in files:
        fb = scan.cuda[f]
        for t in sorted(fb.sass - set(sass) - set(tolerate)) + sorted(fb.ptx - set(ptx) - set(tolerate)):
            unexpected.setdefault(t, []).append(f)
        if not fb.sass & set(sass):
            no_sass.append(f)
    for t, where in sorted(unexpected.items()):
        problems.append(f"unexpected target {t} in {len(where)} file(s), e.g. {where[0]}")
    if no_sass:
        problems.append(f"{len(no_sass)} file(s) carry no SASS for {', '.join(sass)}, e.g. {no_sass[0]}")
    for t in require:
        if t not in found_sass and t not in found_ptx:
            problems.append(f"required target {t} is in no file")
    all_kernels = sorted({k for f in files for k in scan.cuda[f].kernels})
    for pat in kernels:
        if not any(re.search(pat, k) for k in all_kernels):
            problems.append(f"no kernel matches /{pat}/ (of {len(all_kernels)} kernels)")
    if problems:
        allowed = ", ".join(list(sass) + list(ptx)) + (f"; tolerated: {', '.join(tolerate)}" if tolerate else "")
        return False, "; ".join(problems) + f" ({summary}; allowed: {allowed})"
    return True, summary
