"""Package declarations in image.yaml (pkgspec.py) and their part of the stage keys (no network)."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from imagebuild.cli import common as cli
from imagebuild.core.errors import DefinitionError
from imagebuild.definition import pkgspec
from imagebuild.definition import reader as d
from imagebuild.fetch import packages
from imagebuild.plan import planner as plan
from tests.conftest import FIXTURES, run_cli

IMG = "ib-pkgs"


@pytest.fixture
def pkproject(tmp_path) -> Path:
    dst = tmp_path / "project"
    shutil.copytree(FIXTURES / "packages", dst)
    return dst


def _idir(root: Path, image: str = IMG) -> Path:
    return root / "docker-images" / image


def _problems(root: Path, image: str = IMG) -> list:
    with pytest.raises(DefinitionError) as ei:
        d.load(root, image)
    return ei.value.problems


def test_fixture_loads_with_packages(pkproject):
    defn = d.load(pkproject, IMG)
    assert defn.python.version == "3.11" and defn.python.glibc == "2.36" and defn.python.abi == "cp311"
    assert defn.python.index.key == "PYPI_INDEX_URL"
    base, py, app = defn.stages
    assert [a.spec() for a in base.apt.items] == ["jq=1.6-2.1+deb12u2", "python3-pip=23.0.1+dfsg-1"]
    assert [r.spec() for r in py.requirements.items] == ["jinja2==3.1.4", "markupsafe==2.1.5"]
    assert app.requirements is None and app.apt is None


@pytest.mark.parametrize("text, line, fragment", [
    ("jinja2>=3.1\n", 1, "not an exact pin"),
    ("# c\njinja2==3.1.4\njinja2==3.1.4\n", 3, "listed twice"),
    ("jinja2==3.1.4 --hash=md5:abc\n", 1, "unsupported option"),
    ("--index-url https://x.invalid/simple\n", 1, "belong in image.yaml"),
    ("jinja2 @ https://x.invalid/j.whl\n", 1, "direct URLs"),
    ("jinja2==3.1.4; python_version>'3'\n", 1, "environment markers"),
])
def test_requirement_errors_name_file_and_line(pkproject, text, line, fragment):
    (_idir(pkproject) / "requirements-py.txt").write_text(text)
    (p,) = _problems(pkproject)
    assert p.file == f"docker-images/{IMG}/requirements-py.txt" and p.line == line and fragment in p.message


def test_requirement_with_hash_and_continuation_parses(pkproject):
    h = "a" * 64
    (_idir(pkproject) / "requirements-py.txt").write_text(f"jinja2==3.1.4 \\\n    --hash=sha256:{h}\nmarkupsafe==2.1.5\n")
    (r1, r2) = d.load(pkproject, IMG).stage("pydeps").requirements.items
    assert r1.hashes == (h,) and r1.line == 1 and r2.line == 3


@pytest.mark.parametrize("text, fragment", [
    ("JQ\n", "expected name=version"),
    ("jq=\n", "expected name=version"),
    ("jq=1.6 jq=1.7\n", "listed twice"),
    ("\n# nothing\n", "no packages listed"),
])
def test_apt_list_errors(pkproject, text, fragment):
    (_idir(pkproject) / "apt-base.txt").write_text(text)
    (p,) = _problems(pkproject)
    assert p.file == f"docker-images/{IMG}/apt-base.txt" and fragment in p.message


def _yaml(root: Path, old: str, new: str) -> None:
    p = _idir(root) / "image.yaml"
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new))


@pytest.mark.parametrize("old, new, key, fragment", [
    ('version: "3.11"', "version: 3", "python.version", "invalid python version"),
    ('glibc: "2.36"', 'glibc: "2"', "python.glibc", "invalid glibc"),
    ("index_url: PYPI_INDEX_URL", "index_url: NO_SUCH_KEY", "python.index_url", "not a versions.env key"),
    ("index_url: PYPI_INDEX_URL", "index_url: PYPI_INDEX_URL\n  mirror: x", "python.mirror", "unknown key"),
    ("requirements: requirements-py.txt", "requirements: {file: requirements-py.txt, index_url: NOPE}",
     "stages[pydeps].requirements.index_url", "not a versions.env key"),
    ("requirements: requirements-py.txt", "requirements: missing.txt", "stages[pydeps].requirements", "not found"),
])
def test_image_yaml_package_key_errors(pkproject, old, new, key, fragment):
    _yaml(pkproject, old, new)
    (p,) = _problems(pkproject)
    assert p.key == key and fragment in p.message, p


def test_wheels_without_python_is_an_error(pkproject):
    p = _idir(pkproject) / "image.yaml"
    text = p.read_text()
    start, end = text.index("python:"), text.index("stages:")
    p.write_text(text[:start] + text[end:])
    (prob,) = _problems(pkproject)
    assert "installs wheels but image.yaml has no 'python:'" in prob.message


def test_index_url_must_be_a_url_and_is_never_shown_with_credentials(pkproject):
    env = _idir(pkproject) / "versions.env"
    env.write_text(env.read_text().replace("PYPI_INDEX_URL=\n", "PYPI_INDEX_URL=idx.example\n"))
    (p,) = _problems(pkproject)
    assert p.key == "PYPI_INDEX_URL" and "invalid index URL" in p.message
    assert pkgspec.redact_url("https://user:s3cret@idx.example/simple") == "https://***@idx.example/simple"


def test_apt_snapshot_key(pkproject):
    _yaml(pkproject, "stages:", "apt_snapshot: APT_SNAPSHOT\nstages:")
    env = _idir(pkproject) / "versions.env"
    env.write_text(env.read_text() + "APT_SNAPSHOT=2025-01-01\n")
    (p,) = _problems(pkproject)
    assert p.key == "APT_SNAPSHOT" and "YYYYMMDDTHHMMSSZ" in p.message
    env.write_text(env.read_text().replace("2025-01-01", "20250101T000000Z"))
    assert d.load(pkproject, IMG).apt_snapshot == "20250101T000000Z"


def test_platform_tags_cover_every_manylinux_level():
    arm = packages.wheel_platform_tags("linux/arm64", "2.39")
    assert arm[0] == "manylinux_2_39_aarch64" and "manylinux_2_17_aarch64" in arm and "manylinux2014_aarch64" in arm
    assert not any("2_16" in t for t in arm) and all("aarch64" in t for t in arm)
    x86 = packages.wheel_platform_tags("linux/amd64", "2.17")
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64",
            "manylinux_2_5_x86_64"} <= set(x86)
    assert packages.parse_wheel_name("MarkupSafe-2.1.5-cp311-cp311-manylinux_2_17_aarch64.whl") == \
        ("markupsafe", "2.1.5")
    assert packages.parse_wheel_name("torch-2.13.0+cu130-cp312-cp312-manylinux_2_28_aarch64.whl") == \
        ("torch", "2.13.0+cu130")


def _keys(root: Path) -> dict[str, str]:
    return {s.name: s.key for s in plan.make_plan(d.load(root, IMG)).stages}


def test_changing_one_requirement_changes_only_its_stage_and_descendants(pkproject):
    before = _keys(pkproject)
    req = _idir(pkproject) / "requirements-py.txt"
    req.write_text(req.read_text().replace("jinja2==3.1.4", "jinja2==3.1.3"))
    after = _keys(pkproject)
    assert after["base"] == before["base"]
    assert after["pydeps"] != before["pydeps"] and after["app"] != before["app"]
    # an apt change moves the first stage and everything built on it
    apt = _idir(pkproject) / "apt-base.txt"
    apt.write_text(apt.read_text().replace("jq=1.6-2.1+deb12u2", "jq=1.6-2.1"))
    again = _keys(pkproject)
    assert all(again[s] != after[s] for s in ("base", "pydeps", "app"))


def test_index_and_python_target_are_in_the_key(pkproject):
    before = _keys(pkproject)
    env = _idir(pkproject) / "versions.env"
    env.write_text(env.read_text().replace("PYPI_INDEX_URL=\n", "PYPI_INDEX_URL=https://mirror.example/simple\n"))
    after = _keys(pkproject)
    assert after["base"] == before["base"] and after["pydeps"] != before["pydeps"]
    _yaml(pkproject, 'glibc: "2.36"', 'glibc: "2.28"')
    assert _keys(pkproject)["pydeps"] != after["pydeps"]


def test_stage_without_packages_keeps_its_key_document(pkproject):
    """Stages that install nothing get no 'packages' entry: their keys are as before this feature."""
    p = plan.make_plan(d.load(pkproject, IMG))
    assert p.stage("app").packages == {}
    assert set(p.stage("pydeps").packages) == {"wheels"} and p.stage("pydeps").packages["wheels"]["locked"] is None
    assert set(p.stage("base").packages) == {"apt"}


def test_plan_json_and_text_show_packages(pkproject):
    r = run_cli("--root", str(pkproject), "plan", IMG, "--json", "--no-engine")
    assert r.code == 0, r.err
    st = {s["name"]: s for s in json.loads(r.out)["stages"]}
    assert st["pydeps"]["packages"]["wheels"]["inputs"] and st["app"]["packages"] == {}
    r = run_cli("--root", str(pkproject), "plan", IMG, "--no-engine")
    assert "wheels      inputs" in r.out and "NOT PREFETCHED" in r.out


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_network_stage_is_red_only_on_a_terminal_without_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert cli.red("x", _Tty()) == "\033[31mx\033[0m"
    assert cli.red("x", io.StringIO()) == "x"
    monkeypatch.setenv("NO_COLOR", "1")
    assert cli.red("x", _Tty()) == "x"


def test_plan_prints_declared_network_stage(pkproject):
    _yaml(pkproject, "  - name: app\n    from: pydeps", "  - name: app\n    from: pydeps\n    network: true")
    r = run_cli("--root", str(pkproject), "plan", IMG, "--no-engine")
    assert "NEEDS NETWORK (declared 'network: true')" in r.out
    assert "\033[31m" not in r.out  # captured stdout is not a terminal


def test_empty_or_omitted_index_means_pips_configured_index(pkproject, monkeypatch):
    """No index host is written in a definition's defaults: an omitted index_url, or a versions.env
    key set to an empty value, is pip's configured index, read from pip itself at prefetch."""
    from imagebuild.definition.pkgspec import PIP_CONFIGURED, Index

    defn = d.load(pkproject, IMG)
    assert defn.python.index == Index("PYPI_INDEX_URL", None)
    _yaml(pkproject, "  index_url: PYPI_INDEX_URL\n", "")
    assert d.load(pkproject, IMG).python.index == PIP_CONFIGURED
    monkeypatch.setenv("PIP_INDEX_URL", "https://idx.example/simple")
    packages._configured.clear()
    assert packages.pip_index_args(PIP_CONFIGURED, ()) == ["--index-url", "https://idx.example/simple"]
    torch = Index("TORCH_INDEX_URL", "https://torch.example/whl/cu130")
    assert packages.pip_index_args(torch, (PIP_CONFIGURED,)) == [
        "--index-url", "https://torch.example/whl/cu130", "--extra-index-url", "https://idx.example/simple"]
    # nothing configured: pip's own default stays the main index, the others are extra ones
    monkeypatch.delenv("PIP_INDEX_URL")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    packages._configured.clear()
    try:
        assert packages.configured_index_url() is None
        assert packages.pip_index_args(PIP_CONFIGURED, ()) == []
        assert packages.pip_index_args(torch, (PIP_CONFIGURED,)) == [
            "--extra-index-url", "https://torch.example/whl/cu130"]
    finally:
        packages._configured.clear()
    # the key holds "pip's configured index", never a host
    st = d.load(pkproject, IMG).stage("pydeps")
    assert packages.wheel_inputs(d.load(pkproject, IMG), st)["index_url"] is None


def test_a_bare_apt_name_is_visibly_unpinned(pkproject):
    (_idir(pkproject) / "apt-base.txt").write_text("# rdma\njq=1.6-2.1+deb12u2\nlibibverbs1\n")
    defn = d.load(pkproject, IMG)
    items = defn.stage("base").apt.items
    assert [(a.name, a.version, a.spec()) for a in items] == [("jq", "1.6-2.1+deb12u2", "jq=1.6-2.1+deb12u2"),
                                                              ("libibverbs1", None, "libibverbs1")]
    [n] = [n for n in defn.notices if n.key == "libibverbs1"]
    assert n.file == f"docker-images/{IMG}/apt-base.txt" and n.line == 3 and "unpinned apt package" in n.message
