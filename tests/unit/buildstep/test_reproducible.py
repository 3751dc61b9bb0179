"""buildstep/reproducible.py and what uses it (issue 30): every stage's RUN gets SOURCE_DATE_EPOCH
(``ARG SOURCE_DATE_EPOCH`` after each FROM of the Dockerfile as built), and the records of when a
tool ran (RECORDS_OF_WHEN, one list) are left out of a stage's layers by the clamp, with nothing
else changed. The builds themselves: tests/integration/buildstep/test_reproducible.py."""

from __future__ import annotations

import io
import tarfile

import pytest

from imagebuild.buildstep import layerclamp, reproducible
from imagebuild.buildstep.reproducible import dockerfile_for_build
from imagebuild.definition import dockerfile

EPOCH = 1_700_000_000


# ------------------------------------------------------------------------------ the Dockerfile as built


def test_an_arg_after_every_from_and_nothing_else():
    text = ("# a comment\nARG PARENT\nFROM ${PARENT}\nENV A=1\nRUN echo hi\n"
            "FROM ${PARENT} AS other\nRUN true\n")
    out = dockerfile_for_build(text)
    assert out == ("# a comment\nARG PARENT\nFROM ${PARENT}\nARG SOURCE_DATE_EPOCH\nENV A=1\nRUN echo hi\n"
                   "FROM ${PARENT} AS other\nARG SOURCE_DATE_EPOCH\nRUN true\n")
    # removing the added lines gives the file back, byte for byte
    assert out.replace("ARG SOURCE_DATE_EPOCH\n", "") == text
    parsed = dockerfile.parse(out)
    assert [a.name for a in parsed.args if not a.global_scope] == ["SOURCE_DATE_EPOCH"] * 2


def test_a_from_over_several_lines_a_from_in_a_run_and_a_heredoc():
    text = ("FROM \\\n  base \\\n  AS b\nRUN echo \\\n  FROM x\nRUN <<EOF\nFROM not-an-instruction\nEOF\n"
            "FROM b")
    out = dockerfile_for_build(text)
    assert out == ("FROM \\\n  base \\\n  AS b\nARG SOURCE_DATE_EPOCH\nRUN echo \\\n  FROM x\nRUN <<EOF\n"
                   "FROM not-an-instruction\nEOF\nFROM b\nARG SOURCE_DATE_EPOCH\n")


def test_the_escape_directive_is_followed():
    text = "# escape=`\nFROM `\n  base\nRUN dir c:\\\n"
    assert dockerfile_for_build(text) == "# escape=`\nFROM `\n  base\nARG SOURCE_DATE_EPOCH\nRUN dir c:\\\n"


# ------------------------------------------------------------------------------ records of when a tool ran


def test_the_list_is_short_exact_and_says_why():
    assert 0 < len(reproducible.RECORDS_OF_WHEN) <= 16
    for path, why in reproducible.RECORDS_OF_WHEN.items():
        assert path == reproducible.normalized(path) and "*" not in path and "?" not in path
        assert why
    assert "var/log/dpkg.log" in reproducible.DROPPED and "var/cache/ldconfig/aux-cache" in reproducible.DROPPED


def _layer(fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        def add(name, kind=tarfile.REGTYPE, data=b"", **kw):
            ti = tarfile.TarInfo(name)
            ti.type, ti.mtime, ti.mode = kind, EPOCH + 50, 0o644
            for k, v in kw.items():
                setattr(ti, k, v)
            ti.size = len(data) if kind == tarfile.REGTYPE else 0
            t.addfile(ti, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("var", tarfile.DIRTYPE)
        add("var/log", tarfile.DIRTYPE)
        add("var/log/dpkg.log", data=b"2026-12-03 12:00:01 status installed jq:amd64 1.6\n" * 40)
        add("var/log/apt", tarfile.DIRTYPE)
        add("var/log/apt/history.log", data=b"Start-Date: 2026-12-03  12:00:00\n",
            pax_headers={"SCHILY.xattr.user.k": "v"} if fmt == tarfile.PAX_FORMAT else {})
        add("var/log/other.log", data=b"kept\n")
        add("usr/share/doc/var/log/dpkg.log", data=b"same name elsewhere: kept\n")
        add("var/log/.wh.alternatives.log")  # a whiteout: the parent's file removed, kept
        add("var/cache/ldconfig/aux-cache", tarfile.SYMTYPE, linkname="elsewhere")  # not a regular file: kept
        add("opt/" + "long-" * 30 + "/file", data=b"long name\n")
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_the_clamp_leaves_out_exactly_the_listed_files(fmt):
    src = _layer(fmt) if fmt != tarfile.USTAR_FORMAT else _layer_ustar()
    out, dropped = io.BytesIO(), []
    changed = layerclamp.clamp_tar(io.BytesIO(src), out.write, EPOCH + 100, reproducible.DROPPED, dropped)
    want_dropped = ["var/log/dpkg.log"] + (["var/log/apt/history.log"] if fmt != tarfile.USTAR_FORMAT else [])
    assert dropped == want_dropped and changed == len(want_dropped)
    with tarfile.open(fileobj=io.BytesIO(src)) as t:
        before = {m.name: m for m in t.getmembers()}
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as t:
        after = {m.name: (m, t.extractfile(m).read() if m.isfile() else None) for m in t.getmembers()}
    assert set(before) - set(after) == set(want_dropped)
    for name, (m, _data) in after.items():  # everything else as it was, its PAX records included
        b = before[name]
        assert (m.type, m.mode, m.mtime, m.linkname, m.size, m.pax_headers) == \
               (b.type, b.mode, b.mtime, b.linkname, b.size, b.pax_headers), name
    if fmt == tarfile.USTAR_FORMAT:
        assert after["opt/" + "deep/" * 25 + "var/log/dpkg.log"][1] == b"prefix field: kept\n"
    else:
        assert after["usr/share/doc/var/log/dpkg.log"][1] == b"same name elsewhere: kept\n"
    # the same layer without the drop list: byte for byte what it was (no time later than the epoch)
    same = io.BytesIO()
    assert layerclamp.clamp_tar(io.BytesIO(src), same.write, EPOCH + 100) == 0
    assert same.getvalue().rstrip(b"\0") == src.rstrip(b"\0")


def _layer_ustar() -> bytes:
    """A plain ustar layer with a name in the prefix field."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for name, data in (("var/log/dpkg.log", b"2026-12-03 12:00:01 x\n"),
                           ("opt/" + "deep/" * 25 + "var/log/dpkg.log", b"prefix field: kept\n")):
            ti = tarfile.TarInfo(name)
            ti.mtime, ti.size = EPOCH + 50, len(data)
            t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("name", ["var/log/dpkg.log", "./var/log/dpkg.log", "./" + "d" * 120 + "/../var/log/x"])
def test_a_dropped_member_described_by_a_long_name_header_goes_with_it(name):
    """GNU long names ('L' headers) before a member: the dropped member's go with it, the others
    stay (a name with ``..`` is not normalized: the list holds exact paths)."""
    buf = io.BytesIO()
    long_dir = "x" * 120
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for n in (f"{long_dir}/a", name, f"{long_dir}/b"):
            ti = tarfile.TarInfo(n)
            ti.size = 3
            t.addfile(ti, io.BytesIO(b"abc"))
    out = io.BytesIO()
    layerclamp.clamp_tar(io.BytesIO(buf.getvalue()), out.write, EPOCH, reproducible.DROPPED)
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as t:
        kept = t.getnames()
    assert kept == ([f"{long_dir}/a", f"{long_dir}/b"] if "dpkg" in name else [f"{long_dir}/a", name, f"{long_dir}/b"])


def test_an_emulated_arm64_build_mounts_an_aarch64_cpuinfo_in_every_run_without_moving_a_line():
    text = ("FROM a AS x\nrun echo one \\\n  && echo two\nCOPY f /f\n  RUN --mount=type=cache,target=/c echo three\n"
            "RUN [\"echo\", \"four\"]\n")
    plain = reproducible.dockerfile_for_build(text)
    assert reproducible.CPUINFO_MOUNT not in plain
    got = reproducible.dockerfile_for_build(text, cpuinfo=True)
    assert got.count(reproducible.CPUINFO_MOUNT) == 3
    assert len(got.splitlines()) == len(plain.splitlines())
    assert f"run {reproducible.CPUINFO_MOUNT} echo one \\" in got
    assert f"  RUN {reproducible.CPUINFO_MOUNT} --mount=type=cache,target=/c echo three" in got
    assert f'RUN {reproducible.CPUINFO_MOUNT} ["echo", "four"]' in got
    assert "  && echo two" in got  # a continuation line is not an instruction
