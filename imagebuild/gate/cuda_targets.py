"""Which CUDA code a file carries (from ``cuobjdump``'s listing) and the arch rule it must meet.

A CUDA ELF (a ``.so`` with a fatbin) embeds device code per target: SASS for one GPU
architecture (``sm_121a``, ``sm_120f``, ``sm_90``) and PTX that the driver compiles at load time
(``compute_121a``). ``cuobjdump FILE`` prints one header per embedded image, ``Fatbin elf code:``
(SASS) or ``Fatbin ptx code:`` (PTX), each followed by ``arch = sm_XXX``; with
``--dump-resource-usage`` the SASS headers are followed by one ``Function NAME:`` line per kernel.
cuobjdump exits 255 with "does not contain device code" for an ELF without a fatbin.

``cuobjdump -ptx FILE`` prints the PTX text itself after each ``Fatbin ptx code:`` header; its
``.version X.Y`` directive is the PTX ISA version a driver must know to JIT it (the check keeps only
the header, ``arch =`` and ``.version`` lines of that output: a vLLM ``_C`` carries megabytes of PTX).

The rule (the gate's ``cuda-targets`` kind, docs/gate.md): every CUDA ELF carries SASS for at least
one allowed target, and nothing but allowed or tolerated targets (tolerated ones never count as a
file's own); each required target is carried by some file;
each kernel pattern matches a kernel of some file. A file that one of ``libraries`` names is judged
by that library's own list instead: exactly its targets, no more, no fewer. With a ``driver``, every
PTX of every file must have a PTX ISA version that driver can JIT.
Pure: no I/O, so unit tests feed it real listings.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

SASS_RE = re.compile(r"sm_[0-9]{2,3}[af]?\Z")
PTX_RE = re.compile(r"compute_[0-9]{2,3}[af]?\Z")
FRAME = "@@imagebuild-cuda-file "   # the check's shell loop prints it before each file's listing
RC = "@@imagebuild-cuda-rc "        # ... and its exit code after it
NO_DEVICE_CODE = 255                # cuobjdump's exit code for an ELF without device code

_ARCH = re.compile(r"^arch = (sm_[0-9]+[af]?)\s*$")
_FUNC = re.compile(r"^\s*Function (\S+?):\s*$")
_PTX_VERSION = re.compile(r"^\.version\s+([0-9]+\.[0-9]+)\s*$")
# what the PTX pass keeps of ``cuobjdump -ptx`` (grep -E in the image; parse_ptx_versions reads it)
PTX_KEEP = r"^(Fatbin |arch = |\.version )"


@dataclass
class Fatbin:
    """What one file embeds."""
    sass: set[str] = field(default_factory=set)
    ptx: set[str] = field(default_factory=set)     # as compute_XXX
    kernels: set[str] = field(default_factory=set)  # mangled names of its SASS functions
    # (compute_XXX, PTX ISA "X.Y") of each embedded PTX, from ``cuobjdump -ptx`` (only when read)
    ptx_isa: set[tuple[str, str]] = field(default_factory=set)
    ptx_isa_read: bool = False


@dataclass
class Scan:
    """The listing of every file under the checked path."""
    cuda: dict[str, Fatbin] = field(default_factory=dict)    # path -> its device code
    plain: list[str] = field(default_factory=list)           # ELFs without device code
    unreadable: dict[str, str] = field(default_factory=dict)  # path -> cuobjdump's message


def _sections(text: str):
    """Walk ``cuobjdump`` output: (section, arch, line, new) for each line inside an arch's entry of
    the ``Fatbin elf code:`` (``"sass"``) or ``Fatbin ptx code:`` (``"ptx"``) sections; ``new`` is
    True on the line that names the arch (``arch = sm_XXX``)."""
    section, arch = None, None
    for line in text.splitlines():
        s = line.strip()
        if s == "Fatbin elf code:":
            section, arch = "sass", None
        elif s == "Fatbin ptx code:":
            section, arch = "ptx", None
        elif (m := _ARCH.match(s)) and section:
            arch = m.group(1)
            yield section, arch, line, True
        elif section and arch:
            yield section, arch, line, False


def parse_listing(text: str) -> Fatbin:
    """One file's ``cuobjdump [--dump-resource-usage]`` output."""
    fb = Fatbin()
    for section, arch, line, new in _sections(text):
        if new:
            if section == "sass":
                fb.sass.add(arch)
            else:
                fb.ptx.add("compute_" + arch[3:])
        elif (m := _FUNC.match(line)) and section == "sass":
            fb.kernels.add(m.group(1))
    return fb


def parse_ptx_versions(text: str) -> set[tuple[str, str]]:
    """(compute_XXX, PTX ISA version) of each PTX in one file's ``cuobjdump -ptx`` output (or the
    lines of it that PTX_KEEP keeps)."""
    out: set[tuple[str, str]] = set()
    for section, arch, line, new in _sections(text):
        if not new and section == "ptx" and (m := _PTX_VERSION.match(line.strip())):
            out.add(("compute_" + arch[3:], m.group(1)))
    return out


def frames(stdout: str) -> dict[str, tuple[int, str]]:
    """path -> (exit code, its output) of the framed output of the check's loops."""
    out: dict[str, tuple[int, str]] = {}
    path, body = None, []
    for line in stdout.splitlines():
        if line.startswith(FRAME):
            path, body = line[len(FRAME):], []
        elif line.startswith(RC) and path is not None:
            out[path] = (int(line[len(RC):].strip() or "1"), "\n".join(body))
            path, body = None, []
        elif path is not None:
            body.append(line)
    return out


def add_ptx_versions(scan: Scan, stdout: str) -> None:
    """Record, in ``scan``, the PTX ISA versions of the framed ``cuobjdump -ptx`` pass ``stdout``."""
    for path, (rc, text) in frames(stdout).items():
        fb = scan.cuda.get(path)
        if fb is None:
            continue
        if rc != 0:
            msg = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), f"exit {rc}")
            scan.unreadable[path] = f"cuobjdump -ptx: {msg[:200]}"
            continue
        fb.ptx_isa = parse_ptx_versions(text)
        fb.ptx_isa_read = True


def isa_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


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


def library_of(path: str, root: str, libraries) -> dict | None:
    """The first of ``libraries`` whose ``files`` pattern matches ``path`` (relative to ``root``)."""
    rel = path[len(root.rstrip("/")) + 1:] if path.startswith(root.rstrip("/") + "/") else path
    return next((lib for lib in libraries if fnmatch.fnmatchcase(rel, lib["files"])), None)


def judge(scan: Scan, *, sass: list[str], ptx: list[str], require: list[str], kernels: list[str],
          min_files: int, tolerate: list[str] = (), libraries: list[dict] = (), root: str = "",
          driver: dict | None = None) -> tuple[bool, str]:
    """(passed, one-line detail) of the rule on ``scan``; ``root`` is the scanned folder, against
    which ``libraries`` patterns are matched; ``driver`` ({name, cuda, ptx_isa}) the node's."""
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
    per_lib: dict[str, list[str]] = {lib["files"]: [] for lib in libraries}
    lacking: list[str] = []
    for f in files:
        fb = scan.cuda[f]
        lib = library_of(f, root, libraries)
        if lib is not None:  # judged by its own build's list: exactly those targets
            per_lib[lib["files"]].append(f)
            own = set(lib["targets"])
            for t in sorted((fb.sass | fb.ptx) - own):
                unexpected.setdefault(t, []).append(f)
            if own - fb.sass - fb.ptx:
                lacking.append(f"{f} lacks {', '.join(sorted(own - fb.sass - fb.ptx))} "
                               f"(its build asks for {', '.join(lib['targets'])})")
            continue
        for t in sorted(fb.sass - set(sass) - set(tolerate)) + sorted(fb.ptx - set(ptx) - set(tolerate)):
            unexpected.setdefault(t, []).append(f)
        if not fb.sass & set(sass):
            no_sass.append(f)
    for t, where in sorted(unexpected.items()):
        problems.append(f"unexpected target {t} in {len(where)} file(s), e.g. {where[0]}")
    if no_sass:
        problems.append(f"{len(no_sass)} file(s) carry no SASS for {', '.join(sass)}, e.g. {no_sass[0]}")
    if lacking:
        problems.append(f"{len(lacking)} library file(s) lack targets of their own build, e.g. {lacking[0]}")
    for lib in libraries:
        n = len(per_lib[lib["files"]])
        if n < lib.get("min_files", 0):
            problems.append(f"library {lib['files']}: found {n} CUDA ELF(s), expected at least {lib['min_files']}")
    isa_note = ""
    if driver:
        cap = driver["ptx_isa"]
        who = f"driver {driver['name']} (CUDA {driver['cuda']})" if driver.get("name") else f"a CUDA {driver['cuda']} driver"
        too_new, unread = [], []
        for f in files:
            fb = scan.cuda[f]
            if not fb.ptx:
                continue
            if not fb.ptx_isa_read or not fb.ptx <= {a for a, _v in fb.ptx_isa}:
                unread.append(f)
            for arch, ver in sorted(fb.ptx_isa):
                if isa_key(ver) > isa_key(cap):
                    too_new.append(f"{f} ({arch}) is PTX ISA {ver}")
        if too_new:
            problems.append(f"{len(too_new)} PTX image(s) that {who} cannot JIT, as it takes PTX ISA up to "
                            f"{cap}: {'; '.join(too_new[:3])}" + (f" (+{len(too_new) - 3} more)" if len(too_new) > 3 else ""))
        if unread:
            problems.append(f"{len(unread)} file(s) carry PTX whose ISA version could not be read, e.g. {unread[0]}")
        versions = sorted({v for f in files for _a, v in scan.cuda[f].ptx_isa}, key=isa_key)
        isa_note = f"; PTX ISA {', '.join(versions) or 'none'}, {who} takes up to {cap}"
    for t in require:
        if t not in found_sass and t not in found_ptx:
            problems.append(f"required target {t} is in no file")
    all_kernels = sorted({k for f in files for k in scan.cuda[f].kernels})
    for pat in kernels:
        if not any(re.search(pat, k) for k in all_kernels):
            problems.append(f"no kernel matches /{pat}/ (of {len(all_kernels)} kernels)")
    libs = "".join(f"; {lib['files']}: {len(per_lib[lib['files']])} file(s), {'+'.join(lib['targets'])} "
                   f"as its build asks" for lib in libraries)
    summary += libs + isa_note
    if problems:
        allowed = ", ".join(list(sass) + list(ptx)) + (f"; tolerated: {', '.join(tolerate)}" if tolerate else "")
        return False, "; ".join(problems) + f" ({summary}; allowed: {allowed})"
    return True, summary
