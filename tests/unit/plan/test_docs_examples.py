"""The docs' command examples are the commands' own output (issue 35, section 4): the block of
docs/image-definition.md between its ``plan example --no-engine`` markers is what ``imagebuild plan
example --no-engine`` prints in this repository (the revision and the build id aside: they name the last
commit and the checkout's ``origin`` remote, which a clone changes), with a state folder and stage
store of its own (a build the checkout made, ``make demo``'s, would show its stages ``[built]``).
``IMAGEBUILD_DOCS_UPDATE=1`` rewrites the block instead of failing, after a change that moves it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "image-definition.md"
BLOCK = re.compile(r"(<!-- plan example --no-engine: begin -->\n```text\n)(.*?)(```\n<!-- plan example --no-engine: end -->)",
                   re.S)
REVISION = "<the last commit of docker-images/example>"
BUILD_ID = "<16 hex digits>"


def _shown() -> str:
    r = run_cli("--root", str(ROOT), "plan", "example", "--no-engine")
    assert r.code == 0, r.err
    out = re.sub(r"^(revision  )\S+", lambda m: m.group(1) + REVISION, r.out, flags=re.M)
    return re.sub(r"^(build id  )[0-9a-f]{16}\b", lambda m: m.group(1) + BUILD_ID, out, flags=re.M)


@pytest.fixture(autouse=True)
def _own_state(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("IMAGEBUILD_STAGES", str(tmp_path / "stages"))


def test_the_plan_example_in_the_docs_is_what_plan_prints():
    text = DOC.read_text(encoding="utf-8")
    m = BLOCK.search(text)
    assert m, f"{DOC}: no plan example block (its begin/end markers)"
    shown = _shown()
    if os.environ.get("IMAGEBUILD_DOCS_UPDATE") == "1" and m.group(2) != shown:
        DOC.write_text(text[:m.start(2)] + shown + text[m.end(2):], encoding="utf-8")
        return
    assert m.group(2) == shown, ("docs/image-definition.md's plan example is not what `imagebuild plan example "
                                 "--no-engine` prints now; rerun with IMAGEBUILD_DOCS_UPDATE=1 to rewrite it")
