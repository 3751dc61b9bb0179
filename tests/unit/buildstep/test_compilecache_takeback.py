"""The host side of the compiler cache's take-back (buildstep/compilecache.py): a delta applied file by
file, the host copy's files the mount no longer holds removed, the generation written last; a whole
mount replacing the host folder in one rename."""

from __future__ import annotations

from pathlib import Path

from imagebuild.buildstep import compilecache as cc


def _tree(top: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)


def _read(top: Path) -> dict[str, str]:
    return {p.relative_to(top).as_posix(): p.read_text() for p in sorted(top.rglob("*")) if p.is_file()}


def test_a_delta_adds_replaces_and_removes_what_the_mount_did(tmp_path):
    dest, out = tmp_path / "host", tmp_path / "out"
    _tree(dest, {"a/1R": "one", "a/2R": "two", "b/3M": "manifest v1", "stats": "old", cc.GENERATION_FILE: "g1\n"})
    # the compile: a new entry a/4R, b/3M rewritten, ccache's counters; a/2R evicted from the mount
    _tree(out / "files", {"a/4R": "four", "b/3M": "manifest v2", "stats": "new"})
    (out / "manifest").write_text("./a/1R\n./a/4R\n./b/3M\n./stats\n")
    assert cc._apply_delta(out, dest) == 3
    assert _read(dest) == {"a/1R": "one", "a/4R": "four", "b/3M": "manifest v2", "stats": "new",
                           cc.GENERATION_FILE: "g1\n"}
    cc._write_generation(dest, "g2")
    assert (dest / cc.GENERATION_FILE).read_text() == "g2\n"
    assert not list(dest.glob(".*tmp*"))


def test_an_empty_delta_changes_nothing(tmp_path):
    dest, out = tmp_path / "host", tmp_path / "out"
    files = {"a/1R": "one", "stats": "s"}
    _tree(dest, files)
    (out / "files").mkdir(parents=True)
    (out / "manifest").write_text("./a/1R\n./stats\n")
    assert cc._apply_delta(out, dest) == 0
    assert _read(dest) == files


def test_a_whole_mount_replaces_the_host_folder(tmp_path):
    dest, out = tmp_path / "host", tmp_path / "out"
    _tree(dest, {"old/1R": "gone", cc.GENERATION_FILE: "g1\n"})
    _tree(out / "files", {"a/1R": "one", "stats": "s"})
    assert cc._replace(out, dest) == 2
    assert _read(dest) == {"a/1R": "one", "stats": "s"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host", "out"]  # no .old folder left


def test_the_script_and_the_export_agree_on_the_files_of_their_own():
    """What the stage script writes into the mount (start, mode) is what the export leaves out and
    removes; the generation is compared by the script and written by the export."""
    script, export = cc.script().decode(), cc.EXPORT_DOCKERFILE
    for name in (cc.START_FILE, cc.MODE_FILE):
        assert name in script and f"! -name {name}" in export and f"rm -f {cc.START_FILE} {cc.MODE_FILE}" in export
    assert f"{cc.SEED_MOUNT}/{cc.GENERATION_FILE}" in script
    assert f'> {cc.GENERATION_FILE}; cp {cc.GENERATION_FILE} "$out/generation"' in export
