"""Each wheel is stored, and sent to a build, once (issue 32): a stage whose set repeats wheels a stage above
it installs gets only its own in its folder and its requirements file; the lock still lists the whole set,
the repeated ones with the stage that installs them; the chain builds offline and the child imports both.
Real PyPI wheels and Debian packages, the real engine (about 5 MB of downloads)."""

from __future__ import annotations

import json
import shutil

import pytest

from imagebuild.core import lock as lock_mod
from tests.conftest import FIXTURES, run_cli

pytestmark = pytest.mark.engine

IMG = "ib-pkgs"


@pytest.fixture
def project(tmp_path, monkeypatch, engine_info):
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    root = tmp_path / "project"
    shutil.copytree(FIXTURES / "packages", root)
    img = root / "docker-images" / IMG
    y = img / "image.yaml"
    y.write_text(y.read_text().replace("  - name: app\n    from: pydeps\n",
                                       "  - name: more\n    from: pydeps\n    requirements: requirements-more.txt\n"
                                       "  - name: app\n    from: more\n"))
    # the child repeats both of its parent's pins and adds one package of its own
    (img / "requirements-more.txt").write_text("jinja2==3.1.4\nmarkupsafe==2.1.5\nsix==1.16.0\n")
    shutil.copy(img / "Dockerfile.pydeps", img / "Dockerfile.more")
    (img / "Dockerfile.app").write_text(
        "ARG PARENT\nFROM ${PARENT}\nRUN python3 -c \"import jinja2, markupsafe, six; print(six.__version__)\" "
        "> /app-versions\n")
    return root


def test_a_child_stage_gets_only_the_wheels_its_parent_lacks(project):
    r = run_cli("--root", str(project), "prefetch", IMG, "--json")
    assert r.code == 0, r.err
    lock = lock_mod.read(project / "docker-images" / IMG)
    more = {w["name"]: w for w in lock["wheels"]["more"]["files"]}
    assert set(more) == {"jinja2", "markupsafe", "six"}
    assert more["jinja2"]["from_stage"] == "pydeps" and more["markupsafe"]["from_stage"] == "pydeps"
    assert "from_stage" not in more["six"]
    parent = {w["name"]: w["sha256"] for w in lock["wheels"]["pydeps"]["files"]}
    assert more["jinja2"]["sha256"] == parent["jinja2"]  # the same file, recorded once
    folder = project / "deps-src" / IMG / "wheels" / "more"
    assert sorted(p.name for p in folder.iterdir()) == ["requirements.txt", more["six"]["filename"]]
    reqs = (folder / "requirements.txt").read_text()
    assert "six==1.16.0 --hash=sha256:" in reqs and "jinja2" not in reqs and "markupsafe" not in reqs
    # a second prefetch reuses it all and changes nothing
    again = run_cli("--root", str(project), "prefetch", IMG, "--json")
    assert again.code == 0, again.err
    assert lock_mod.read(project / "docker-images" / IMG) == lock
    # the chain builds offline from what is there: the child installs six, and finds the rest installed
    b = run_cli("--root", str(project), "build", IMG, "--no-gate", "--force", "--json")
    assert b.code == 0, b.err[-3000:]
    rec = json.loads(b.out)
    assert [s["name"] for s in rec["stages"]] == ["base", "pydeps", "more", "app"]
