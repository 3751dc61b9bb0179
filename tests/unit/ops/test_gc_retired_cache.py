"""gc and the retired parse cache: an earlier version left $XDG_CACHE_HOME/imagebuild/parse behind;
nothing reads it now, so gc lists it (kind parse-cache) and removes it, and leaves alone what is not it."""

from __future__ import annotations

from imagebuild.ops import gc


def test_an_earlier_parse_cache_is_listed_with_its_bytes_and_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    old = tmp_path / "imagebuild" / "parse"
    (old / "ab").mkdir(parents=True)
    (old / "ab" / "entry").write_bytes(b"x" * 1000)
    items = gc.plan_parse_cache()
    assert [(i.kind, i.path, i.bytes) for i in items] == [("parse-cache", str(old), 1000)]
    plan = gc.GcPlan(3, [], items)
    gc.apply(plan, tmp_path)
    assert not old.exists() and (tmp_path / "imagebuild").is_dir()


def test_nothing_to_list_without_one_and_never_through_a_link(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gc.plan_parse_cache() == []
    elsewhere = tmp_path / "keep"
    elsewhere.mkdir()
    (tmp_path / "imagebuild").mkdir()
    (tmp_path / "imagebuild" / "parse").symlink_to(elsewhere)
    assert gc.plan_parse_cache() == []
