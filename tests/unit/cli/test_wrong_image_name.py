"""One voice for a wrong image name (issue 35, section 2): every command that takes an IMAGE says
the same thing for a typo, with a did-you-mean (``definition/reader.py`` ``unknown_image``), and
names another checkout only when the shared stage store really holds that image."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

TYPO = "tiyn"  # the fixture project's "tiny", mistyped
SAID = f"docker-images/{TYPO}: IMAGE: no such image"
MEANT = "did you mean 'tiny'?"

COMMANDS = [
    ("log", TYPO), ("df", TYPO), ("gc", TYPO), ("gc", TYPO, "--dry-run"), ("report", "--history", TYPO),
    ("report", "--html", TYPO), ("report", TYPO), ("report", TYPO, "latest"),
    ("build", TYPO), ("plan", TYPO), ("prefetch", TYPO), ("validate", TYPO), ("gate", TYPO),
    ("sync", "--image", TYPO, "dgx4"), ("nightly", TYPO), ("rollback", TYPO), ("bundle", TYPO, "-o", "/tmp/x.tar"),
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a))
def test_every_command_says_a_wrong_image_name_the_same_way(project, argv):
    r = run_cli("--root", str(project), *argv)
    assert r.code == 2, (r.code, r.err)
    assert SAID in r.err and MEANT in r.err, r.err
    assert "another checkout" not in r.err  # nothing of that name anywhere: no other checkout to blame
    assert "expected at most one IMAGE" not in r.err and "Traceback" not in r.err


def test_no_close_name_lists_the_known_images(project):
    r = run_cli("--root", str(project), "log", "zzzzzz")
    assert r.code == 2 and "known images: mirror, staged, tiny (imagebuild list)" in r.err, r.err


def test_another_checkout_is_named_only_when_the_stage_store_holds_that_image(project, tmp_path, monkeypatch):
    stages = tmp_path / "stages"
    refs = stages / "theirs" / "refs"
    refs.mkdir(parents=True)
    (refs / ("ab" * 32 + ".json")).write_text(json.dumps({"schema": "imagebuild.stage-ref", "key": "sha256:" + "ab" * 32,
                                                          "stage": "base", "manifest": "sha256:" + "cd" * 32}))
    monkeypatch.setenv("IMAGEBUILD_STAGES", str(stages))
    for argv in (("log", "theirs"), ("df", "theirs"), ("gc", "theirs")):
        r = run_cli("--root", str(project), *argv)
        assert r.code == 2 and "docker-images/theirs: IMAGE: no such image in this project" in r.err, r.err
        assert "the shared stage store holds 1 stage(s) of 'theirs': they belong to another checkout" in r.err
    r = run_cli("--root", str(project), "log", "ours")
    assert r.code == 2 and "another checkout" not in r.err, r.err


def test_an_image_where_the_peer_goes_is_noticed_with_the_right_form(project):
    r = run_cli("--root", str(project), "sync", "tiny")
    assert r.code == 2, r.err
    assert "'tiny' is an image of this project (docker-images/tiny/), not a peer" in r.err, r.err
    assert "hint: imagebuild sync --image tiny" in r.err


def test_diff_offers_the_image_a_mistyped_reference_meant(project, engine_ready):
    r = run_cli("--root", str(project), "diff", f"{TYPO}:local", "tiny:local")
    assert r.code == 1 and "did you mean 'tiny:local'?" in r.err, r.err
