"""core/emulation.py: the kernel's binfmt_misc table read as the kernel writes it, the handler that runs an
architecture found by the ELF header, and the refusal that says how to register one."""

from __future__ import annotations

import pytest

from imagebuild.core import emulation
from imagebuild.core.errors import GuardRefused

# /proc/sys/fs/binfmt_misc/qemu-aarch64 as Debian's qemu-user-static registers it
QEMU_AARCH64 = """enabled
interpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P
flags: PF
offset 0
magic 7f454c460201010000000000000000000200b700
mask ffffffffffffff00fffffffffffffffffeffffff
"""


def _table(tmp_path, **entries: str):
    for name, text in entries.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "register").write_text("")
    (tmp_path / "status").write_text("enabled\n")
    return emulation.handlers(tmp_path)


def test_the_kernels_entry_is_parsed_with_its_flags(tmp_path):
    (h,) = _table(tmp_path, **{"qemu-aarch64": QEMU_AARCH64})
    assert h.enabled and h.flags == "PF" and h.in_containers
    assert h.interpreter == "/usr/libexec/qemu-binfmt/aarch64-binfmt-P"


@pytest.mark.parametrize("arch", sorted(emulation.ELF))
def test_a_handler_matches_its_own_architecture_alone(tmp_path, arch):
    table = _table(tmp_path, **{"qemu-aarch64": QEMU_AARCH64})
    found = emulation.handler_for(arch, table)
    assert (found is not None) == (arch == "arm64")


def test_disabled_handler_or_extension_entry_runs_nothing(tmp_path):
    table = _table(tmp_path, **{"qemu-aarch64": QEMU_AARCH64.replace("enabled", "disabled", 1),
                                "python3.11": "enabled\ninterpreter /usr/bin/python3.11\nflags: \nextension .pyc\n"})
    assert emulation.handler_for("arm64", table) is None
    assert [h.name for h in table] == ["qemu-aarch64"]


def test_a_fifo_in_the_table_is_not_read(tmp_path):
    import os

    os.mkfifo(tmp_path / "qemu-riscv64")
    assert [h.name for h in _table(tmp_path, **{"qemu-aarch64": QEMU_AARCH64})] == ["qemu-aarch64"]


def test_check_refuses_a_handler_without_the_f_flag_and_says_how(tmp_path, monkeypatch):
    table = _table(tmp_path, **{"qemu-aarch64": QEMU_AARCH64.replace("flags: PF", "flags: P")})
    monkeypatch.setattr(emulation, "handlers", lambda *a: table)
    with pytest.raises(GuardRefused) as exc:
        emulation.check("linux/arm64", engine_arch="x86_64")
    text = exc.value.render()
    assert "lacks the F (fix-binary) flag" in text and "update-binfmts --enable qemu-aarch64" in text
    assert exc.value.exit_code == 3


def test_check_names_the_handler_and_native_needs_none(tmp_path, monkeypatch):
    table = _table(tmp_path, **{"qemu-aarch64": QEMU_AARCH64})
    monkeypatch.setattr(emulation, "handlers", lambda *a: table)
    assert "qemu-aarch64" in emulation.check("linux/arm64", engine_arch="x86_64")
    assert emulation.check("linux/arm64", engine_arch="aarch64") == "native"
    with pytest.raises(GuardRefused, match="no enabled binfmt_misc handler for riscv64"):
        emulation.check("linux/riscv64", engine_arch="x86_64")


def test_the_cpuinfo_stand_in_is_the_arm64_kernels_format():
    text = emulation.aarch64_cpuinfo(2)
    assert text.count("processor\t:") == 2 and "CPU implementer\t: 0x41" in text and "x86" not in text
