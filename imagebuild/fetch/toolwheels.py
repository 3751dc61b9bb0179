"""The programs a wheel ships must run on the stage's C library.

A wheel's platform tag promises the oldest glibc its *libraries* need, by the manylinux rules, but
nothing checks the programs some wheels carry (CUDA's ``nvidia-cuda-cuobjdump`` puts ``cuobjdump`` under
``nvidia/cu13/bin/``): PyPI's aarch64 cuobjdump 13.5 is tagged ``manylinux_2_17`` and needs glibc 2.38,
so on a bookworm (2.36) stage it stops with ``GLIBC_2.38 not found`` the first time the gate runs it.
Prefetch reads the symbol versions each program of the resolved wheels requires (the ELF file's
``.gnu.version_r`` section: the ``GLIBC_2.N`` names it was linked against) and refuses a set whose
program needs a newer glibc than the definition's ``python.glibc``, naming the wheel, the program and
both versions, before anything reaches ``deps-src``.

Programs are the ELF files in a ``bin/`` folder of the wheel or under ``<name>.data/scripts/``; shared
libraries are left to the import checks of the gate (reading every library of a 3 GB torch set at each
prefetch would cost more than it finds).
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

SHT_GNU_VERNEED = 0x6FFFFFFE


def _is_program(name: str) -> bool:
    parts = name.split("/")
    return "bin" in parts[:-1] or (len(parts) > 2 and parts[0].endswith(".data") and parts[1] == "scripts")


def glibc_needed(data: bytes) -> tuple[int, ...] | None:
    """The newest ``GLIBC_x.y[.z]`` version an ELF file requires (from its version-needs section);
    None for a file that is not ELF or needs no versioned glibc symbol."""
    if data[:4] != b"\x7fELF" or len(data) < 64:
        return None
    cls, order = data[4], data[5]
    end = "<" if order == 1 else ">"
    try:
        if cls == 2:
            shoff, = struct.unpack_from(end + "Q", data, 0x28)
            shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
            sec = end + "IIQQQQIIQQ"  # name type flags addr offset size link info addralign entsize
        else:
            shoff, = struct.unpack_from(end + "I", data, 0x20)
            shentsize, shnum = struct.unpack_from(end + "HH", data, 0x2E)
            sec = end + "IIIIIIIIII"
        sections = [struct.unpack_from(sec, data, shoff + i * shentsize) for i in range(shnum)]
        best: tuple[int, ...] | None = None
        for s in sections:
            if s[1] != SHT_GNU_VERNEED:
                continue
            off, link, count = s[4], s[6], s[7]
            strtab = sections[link][4]
            pos = off
            for _ in range(count):
                _ver, cnt, _file, aux, nxt = struct.unpack_from(end + "HHIII", data, pos)
                apos = pos + aux
                for _ in range(cnt):
                    _hash, _flags, _other, name, anext = struct.unpack_from(end + "IHHII", data, apos)
                    stop = data.index(b"\0", strtab + name)
                    text = data[strtab + name:stop].decode("ascii", "replace")
                    if text.startswith("GLIBC_") and text[6:].replace(".", "").isdigit():
                        v = tuple(int(x) for x in text[6:].split("."))
                        best = v if best is None or v > best else best
                    if not anext:
                        break
                    apos += anext
                if not nxt:
                    break
                pos += nxt
        return best
    except (struct.error, IndexError, ValueError):
        return None


def programs_too_new(wheel: Path, glibc: str) -> list[tuple[str, str]]:
    """(program, glibc it needs) for each program of ``wheel`` that needs more than ``glibc``."""
    have = tuple(int(x) for x in glibc.split("."))
    out = []
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir() or not _is_program(info.filename):
                continue
            with z.open(info) as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
            need = glibc_needed(z.read(info))
            if need is not None and need > have:
                out.append((info.filename, ".".join(map(str, need))))
    return out
