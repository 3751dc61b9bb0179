"""Running foreign-architecture code: which binfmt_misc handler (QEMU user mode) would run it.

An engine on an x86-64 host runs a linux/arm64 container only when the kernel has a binfmt_misc
handler for AArch64 ELF files, registered with the ``F`` (fix-binary) flag so that the interpreter
is opened at registration and works inside a container's own root. This module answers, from the
kernel's own table (``/proc/sys/fs/binfmt_misc``), which handler matches the ELF header of an
architecture; and, through the engine, which platforms BuildKit says it can run. Nothing here
registers anything: the hint says how (docs/build.md, "Building for another platform").

Docker-style architecture names throughout (``amd64``, ``arm64``, ``riscv64``...).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import lazy
from imagebuild.core.errors import OperationFailed

run_mod = lazy.module("imagebuild.core.run")

BINFMT_DIR = Path("/proc/sys/fs/binfmt_misc")

REGISTER_HINT = ("register a QEMU user-mode handler on the engine's host, as root: `apt-get install "
                 "qemu-user-static binfmt-support` (Debian, Ubuntu), then, where /proc/sys/fs/binfmt_misc is "
                 "empty, `mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc` and `update-binfmts "
                 "--enable qemu-{qemu}`; the handler needs the F flag to work inside containers "
                 "(scripts/testbed.sh does all of it)")

# ELF identity per architecture: (EI_CLASS: 1 = 32-bit, 2 = 64-bit; EI_DATA: 1 = little, 2 = big endian;
# e_machine), from the ELF specification's machine numbers; and QEMU's name for it.
ELF = {
    "amd64": (2, 1, 62, "x86_64"),
    "386": (1, 1, 3, "i386"),
    "arm64": (2, 1, 183, "aarch64"),
    "arm": (1, 1, 40, "arm"),
    "ppc64le": (2, 1, 21, "ppc64le"),
    "s390x": (2, 2, 22, "s390x"),
    "riscv64": (2, 1, 243, "riscv64"),
}


def elf_header(arch: str, e_type: int = 2) -> bytes:
    """The first 20 bytes of an ELF executable (``e_type`` 2) or shared object (3) for ``arch``."""
    cls, data, machine, _ = ELF[arch]
    order = "little" if data == 1 else "big"
    return (b"\x7fELF" + bytes([cls, data, 1]) + bytes(9) + e_type.to_bytes(2, order)
            + machine.to_bytes(2, order))


@dataclass(frozen=True)
class Handler:
    """One binfmt_misc entry, as the kernel shows it."""

    name: str
    enabled: bool
    interpreter: str
    flags: str
    offset: int
    magic: bytes
    mask: bytes

    def matches(self, header: bytes) -> bool:
        """Does this handler take a file that starts with ``header``?"""
        end = self.offset + len(self.magic)
        if not self.magic or end > len(header):
            return False
        mask = self.mask or b"\xff" * len(self.magic)
        window = header[self.offset:end]
        return all((w & m) == (g & m) for w, m, g in zip(window, mask, self.magic, strict=False))

    @property
    def in_containers(self) -> bool:
        """With the F flag the kernel opened the interpreter at registration: it runs in any root."""
        return "F" in self.flags

    def describe(self) -> str:
        return f"{self.name} ({self.interpreter}, flags {self.flags or '-'})"


def parse_entry(name: str, text: str) -> Handler | None:
    """A binfmt_misc entry file's text -> Handler; None for an extension-based entry or nonsense."""
    fields: dict[str, str] = {}
    enabled = False
    for line in text.splitlines():
        line = line.strip()
        if line in ("enabled", "disabled"):
            enabled = line == "enabled"
        elif " " in line:
            k, v = line.split(" ", 1)
            fields[k.rstrip(":")] = v.strip()  # "flags: PF", "interpreter /usr/..."
    try:
        magic = bytes.fromhex(fields.get("magic", ""))
        mask = bytes.fromhex(fields.get("mask", ""))
        offset = int(fields.get("offset", "0"))
    except ValueError:
        return None
    if not magic:
        return None
    flags = fields.get("flags", "").strip()
    return Handler(name, enabled, fields.get("interpreter", ""), flags, offset, magic, mask)


def handlers(binfmt_dir: Path = BINFMT_DIR) -> list[Handler]:
    """The kernel's magic-based handlers; [] where binfmt_misc is not mounted or not readable."""
    out = []
    try:
        entries = sorted(binfmt_dir.iterdir())
    except OSError:
        return []
    for p in entries:
        if p.name in ("register", "status"):
            continue
        try:
            # the kernel's own small files: read a bounded amount (never a FIFO planted in a test dir)
            if not p.is_file():
                continue
            with p.open("rb") as fh:
                text = fh.read(4096).decode("ascii", "replace")
        except OSError:
            continue
        h = parse_entry(p.name, text)
        if h is not None:
            out.append(h)
    return out


def handler_for(arch: str, table: list[Handler] | None = None) -> Handler | None:
    """The enabled handler that runs ``arch``'s executables and shared objects, if any."""
    if arch not in ELF:
        return None
    table = handlers() if table is None else table
    for h in table:
        if h.enabled and h.matches(elf_header(arch, 2)) and h.matches(elf_header(arch, 3)):
            return h
    return None


def qemu_name(arch: str) -> str:
    return ELF[arch][3] if arch in ELF else arch


def engine_platforms() -> list[str] | None:
    """The platforms the engine's BuildKit says it can run (``docker buildx inspect``): natively and
    through the emulators it found; None when it cannot be asked."""
    try:
        proc = run_mod.run(["docker", "buildx", "inspect"], check=False, timeout=30)
    except OperationFailed:  # no answer is an answer: the caller falls back to the kernel's table
        return None
    if proc.returncode != 0:
        return None
    for line in proc.stdout.decode("utf-8", "replace").splitlines():
        if line.strip().startswith("Platforms:"):
            return [p.strip() for p in line.split(":", 1)[1].split(",") if p.strip()]
    return None


_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm",
         "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64", "i686": "386", "i386": "386"}


def docker_arch(machine: str) -> str:
    """``uname -m`` (or an engine's Architecture) -> the Docker-style name: ``x86_64`` -> ``amd64``."""
    m = machine.lower()
    return _ARCH.get(m, m)


def check(target: str, *, engine_arch: str | None = None, platforms: list[str] | None | bool = False) -> str:
    """Can the engine run ``target``'s code (natively or through a registered handler)? Returns how
    (the handler, or the engine's word); raises ``GuardRefused`` (exit 3) saying how to register one.
    ``platforms``: the engine's BuildKit platform list (False: ask it now; None: it gave none)."""
    import platform as _platform

    from imagebuild.core import remote_engine
    from imagebuild.core.errors import GuardRefused

    want = arch_of(target)
    have = docker_arch(engine_arch or _platform.machine())
    if want == have:
        return "native"
    if remote_engine.active() is None:
        # a local engine shares this kernel: its binfmt_misc table is the truth (BuildKit's platform list
        # is probed once and kept: it still named linux/arm64 here after the handler was disabled)
        handler = handler_for(want)
        if handler is not None and handler.in_containers:
            return f"binfmt handler {handler.describe()}"
        if handler is not None:
            why = (f"this kernel's handler {handler.describe()} lacks the F (fix-binary) flag, so containers, "
                   "whose root holds no interpreter, cannot use it")
        else:
            why = f"this kernel has no enabled binfmt_misc handler for {qemu_name(want)} ELF files ({BINFMT_DIR})"
    else:
        if platforms is False:
            platforms = engine_platforms()
        if platforms is not None and any(arch_of(p) == want for p in platforms):
            return f"the engine's BuildKit lists linux/{want}"
        why = ("the engine's BuildKit lists " + (", ".join(platforms) or "nothing") if platforms is not None
               else "the engine's BuildKit platforms could not be read (docker buildx inspect)")
    raise GuardRefused(f"the engine cannot run {target} code on this linux/{have} host: {why}",
                       hint=REGISTER_HINT.format(qemu=qemu_name(want)))


def arch_of(platform: str) -> str:
    """``linux/arm64/v8`` -> ``arm64``."""
    parts = platform.split("/")
    return parts[1] if len(parts) > 1 else parts[0]


# An AArch64 /proc/cpuinfo for containers run under QEMU user mode: the process otherwise reads the
# host's x86 cpuinfo, and libraries that identify the CPU from it (torch's oneDNN through
# xbyak_aarch64: "Can't open MIDR_EL1 sysfs entry", then a segmentation fault) die at import. The
# fields are the kernel's arm64 format; the CPU named is an Arm Neoverse-N1 (implementer 0x41, part
# 0xd0c), an ARMv8.2 core whose features QEMU's default "max" CPU covers. It describes no real host.
_CPUINFO_FEATURES = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc "
                     "dcpop asimddp")


def aarch64_cpuinfo(cpus: int) -> str:
    blocks = []
    for i in range(max(1, cpus)):
        blocks.append(f"processor\t: {i}\nBogoMIPS\t: 50.00\nFeatures\t: {_CPUINFO_FEATURES}\n"
                      "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\n"
                      "CPU revision\t: 1\n")
    return "\n".join(blocks) + "\n"
