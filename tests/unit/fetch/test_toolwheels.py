"""fetch/toolwheels.py: the glibc a program needs, read from its ELF version-needs section."""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

from imagebuild.fetch import toolwheels


def test_this_interpreter_needs_the_newest_glibc_name_its_dynamic_strings_hold():
    data = Path(sys.executable).resolve().read_bytes()
    need = toolwheels.glibc_needed(data)
    names = {tuple(int(x) for x in m.decode().split(".")) for m in re.findall(rb"GLIBC_(2\.[0-9]+(?:\.[0-9]+)?)\0",
                                                                               data)}
    assert need is not None and need == max(names)


def test_not_elf_or_damaged_is_no_answer_and_no_crash():
    assert toolwheels.glibc_needed(b"#!/bin/sh\n") is None
    data = Path(sys.executable).resolve().read_bytes()
    for cut in (16, 64, 4096):
        toolwheels.glibc_needed(data[:cut])  # never raises


def test_only_programs_are_read(tmp_path):
    exe = Path(sys.executable).resolve().read_bytes()
    w = tmp_path / "x-1-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("x/bin/tool", exe)
        z.writestr("x/lib/libx.so", exe)  # a library: left to the gate's imports
        z.writestr("x-1.data/scripts/run", exe)
        z.writestr("x/bin/script.sh", b"#!/bin/sh\n")
    got = toolwheels.programs_too_new(w, "2.0")
    assert sorted(p for p, _ in got) == ["x-1.data/scripts/run", "x/bin/tool"]
    assert toolwheels.programs_too_new(w, "9.99") == []
