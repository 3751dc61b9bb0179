"""A stage's key hashes its context as the stream the build sends (plan/context_stream.py, issue 21).

Property: every change that reaches the image (a file's x bit, an empty folder, a link's target, to a
file or to a folder, a file's type) gives a new key; what never reaches it (the rest of a file's
mode, owners, mtimes, the clone's path) gives the same key. And each of the stream's fields is needed:
with any one of them left out of the stream, the matching mutation goes unseen.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from imagebuild.core.errors import DefinitionError
from imagebuild.definition import reader as definition
from imagebuild.plan import context_stream
from imagebuild.plan import planner as plan

IMG = "ctx"


def _project(root: Path) -> Path:
    d = root / "docker-images" / IMG
    (d / "files" / "src" / "sub").mkdir(parents=True)
    (d / "files" / "src" / "sub2").mkdir()
    (d / "files" / "src" / "sub" / "a.h").write_text("int a;\n")
    (d / "files" / "src" / "sub2" / "a.h").write_text("int b;\n")
    (d / "files" / "src" / "tool.sh").write_text("echo tool\n")
    os.symlink("sub", d / "files" / "src" / "inc")
    os.symlink("sub/a.h", d / "files" / "src" / "a.h")
    (d / "versions.env").write_text("BASE_IMAGE=imagebuild-test/busybox:1\n")
    (d / "image.yaml").write_text("platform: linux/amd64\nstages:\n  - name: s\n    from: BASE_IMAGE\n"
                                  "    files: [files/src]\n")
    (d / "Dockerfile.s").write_text("ARG PARENT\nFROM ${PARENT}\nCOPY files/src /opt/src\n")
    return root


def key(root: Path) -> str:
    return plan.make_plan(definition.load(root, IMG)).stages[0].key


@pytest.fixture
def root(tmp_path):
    return _project(tmp_path / "p")


def src(root: Path) -> Path:
    return root / "docker-images" / IMG / "files" / "src"


MUTATIONS = {
    "x bit": lambda s: os.chmod(s / "tool.sh", 0o755),
    "empty folder": lambda s: (s / "empty").mkdir(),
    "folder link target": lambda s: (os.unlink(s / "inc"), os.symlink("sub2", s / "inc")),
    "file link target": lambda s: (os.unlink(s / "a.h"), os.symlink("sub2/a.h", s / "a.h")),
    "type: link becomes the folder": lambda s: (os.unlink(s / "inc"), shutil.copytree(s / "sub", s / "inc")),
    "content": lambda s: (s / "tool.sh").write_text("echo TOOL\n"),
    "name": lambda s: os.rename(s / "tool.sh", s / "tool2.sh"),
}

NO_OPS = {
    "group/other bits (umask 077 clone)": lambda s: [os.chmod(p, 0o600) for p in s.rglob("*.h") if not p.is_symlink()],
    "owner": lambda s: os.chown(s / "tool.sh", 1234, 4321),
    "mtime": lambda s: os.utime(s / "tool.sh", (1, 1)),
}


@pytest.mark.parametrize("what", sorted(MUTATIONS))
def test_what_reaches_the_image_moves_the_key(root, what):
    before = key(root)
    MUTATIONS[what](src(root))
    assert key(root) != before


@pytest.mark.parametrize("what", sorted(NO_OPS))
def test_what_never_reaches_the_image_keeps_the_key(root, what):
    before = key(root)
    NO_OPS[what](src(root))
    assert key(root) == before


def test_another_clone_at_another_path_has_the_same_key(root, tmp_path):
    other = tmp_path / "elsewhere" / "clone"
    shutil.copytree(root, other, symlinks=True)
    assert key(other) == key(root)


def test_the_context_built_is_the_stream_hashed(root, tmp_path):
    """Extracted as the build does: normalized modes, the empty folder and both links are there."""
    from imagebuild.buildstep import builder

    (src(root) / "empty").mkdir()
    for p in src(root).rglob("*"):
        if not p.is_symlink():
            os.chmod(p, 0o700 if p.is_dir() else 0o600)
    st = plan.make_plan(definition.load(root, IMG)).stages[0]
    dest = tmp_path / "ctx"
    builder.make_context(root, st, dest, st.source_date_epoch)
    got = dest / "files" / "src"
    assert (got / "empty").is_dir() and os.readlink(got / "inc") == "sub" and os.readlink(got / "a.h") == "sub/a.h"
    assert oct((got / "tool.sh").stat().st_mode & 0o777) == oct(0o644)
    assert oct((got / "sub").stat().st_mode & 0o777) == oct(0o755)
    # an input changed after planning is refused, never sent under the old key
    (src(root) / "tool.sh").write_text("changed\n")
    with pytest.raises(Exception, match="changed since the plan was made"):
        builder.make_context(root, st, tmp_path / "ctx2", st.source_date_epoch)


def test_a_fifo_is_refused_by_name_instead_of_hanging(root):
    os.mkfifo(src(root) / "pipe")
    with pytest.raises(DefinitionError) as ei:
        key(root)
    assert "files/src/pipe" in ei.value.render() and "is a FIFO" in ei.value.render()


def _members(data: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return tf.getmembers()


def test_the_stream_is_normalized_tar(root):
    ents = context_stream.entries([(src(root), "files/src", "files/src")])
    buf = io.BytesIO()
    context_stream.write(ents, 315532800, buf)
    ms = _members(buf.getvalue())
    assert [m.name for m in ms] == [e.name for e in ents]
    assert {(m.uid, m.gid, m.uname, m.gname, m.mtime) for m in ms} == {(0, 0, "", "", 315532800)}
    assert ms[0].name == "files" and ms[0].isdir()  # parents first, also implicit ones


# each field of the stream, and the mutation only that field carries
FIELD_OF = {"mode": "x bit", "type": "type: link becomes the folder", "linkname": "folder link target",
            "empty folders": "empty folder"}


@pytest.mark.parametrize("field", sorted(FIELD_OF))
def test_leaving_a_field_out_of_the_stream_would_hide_its_mutation(root, field, monkeypatch):
    real_tarinfo, real_entries = context_stream._tarinfo, context_stream.entries

    def tarinfo(e, epoch):
        ti = real_tarinfo(e, epoch)
        if field == "mode":
            ti.mode = 0o644
        if field == "linkname" and ti.issym():
            ti.linkname = ""
        return ti

    def entries(inputs):
        out = real_entries(inputs)
        if field == "type":  # a link and the folder it names written alike
            out = [context_stream.Entry(e.name, "dir", 0o755) if e.kind == "link" and e.name.endswith("/inc") else e
                   for e in out if not e.name.startswith("files/src/inc/")]
        if field == "empty folders":
            kept = {str(Path(x.name).parent) for x in out}
            out = [e for e in out if e.kind != "dir" or e.name in kept or e.name == "files/src"]
        return out

    monkeypatch.setattr(context_stream, "_tarinfo", tarinfo)
    monkeypatch.setattr(context_stream, "entries", entries)
    before = key(root)
    MUTATIONS[FIELD_OF[field]](src(root))
    assert key(root) == before, f"with {field} left out, the mutation would go unseen"
