"""A base image whose platform is not the definition's is refused before the build (issue 9,
section 8): a real local amd64-only image under a definition for linux/arm64."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile

import pytest

from imagebuild.buildstep import guards
from imagebuild.core.errors import DefinitionError
from imagebuild.definition import reader as definition
from tests.conftest import tree_state

pytestmark = pytest.mark.engine

IMG = "docker-images/tiny"


def _import(tag: str, platform: str) -> None:
    """A one-file image of ``platform`` made with `docker import --platform` (no registry)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"imagebuild platform test\n"
        info = tarfile.TarInfo("etc/marker")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    subprocess.run(["docker", "import", "--platform", platform, "-", tag], input=buf.getvalue(), check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def images(engine_info):
    tags = {p: f"imagebuild-test/platform-{p.split('/')[1]}:t{os.getpid()}" for p in ("linux/amd64", "linux/arm64")}
    for platform, tag in tags.items():
        _import(tag, platform)
    yield tags
    subprocess.run(["docker", "image", "rm", *tags.values()], capture_output=True)


def _definition(project, platform: str, base: str):
    d = project / IMG
    (d / "image.yaml").write_text((d / "image.yaml").read_text().replace("platform: linux/amd64",
                                                                        f"platform: {platform}"))
    env = d / "versions.env"
    env.write_text(env.read_text().replace("BASE_IMAGE=imagebuild-test/busybox:1", f"BASE_IMAGE={base}"))
    return definition.load(project, "tiny")


def test_amd64_base_under_arm64_definition_is_refused(project, images, engine_info):
    defn = _definition(project, "linux/arm64", images["linux/amd64"])
    assert guards.image_platform(images["linux/amd64"]) == "linux/amd64"
    before = tree_state(project)
    with pytest.raises(DefinitionError) as exc:
        guards.check_base_platforms(defn, engine_info)
    assert exc.value.exit_code == 2
    text = exc.value.render()
    assert f"{IMG}/versions.env:2: BASE_IMAGE" in text
    assert "is linux/amd64" in text and "platform is linux/arm64" in text and "--emulate does not help" in text
    assert tree_state(project) == before


def test_base_of_the_definitions_platform_passes(project, images, engine_info):
    defn = _definition(project, "linux/arm64", images["linux/arm64"])
    assert guards.check_base_platforms(defn, engine_info) == []
    project2 = project.parent / "p2"
    import shutil

    shutil.copytree(project, project2)
    defn = _definition(project2, "linux/arm64", images["linux/arm64"])
    # the amd64 definition with the arm64 base is refused the other way round
    (project2 / IMG / "image.yaml").write_text(
        (project2 / IMG / "image.yaml").read_text().replace("linux/arm64", "linux/amd64"))
    with pytest.raises(DefinitionError) as exc:
        guards.check_base_platforms(definition.load(project2, "tiny"), engine_info)
    assert "is linux/arm64" in exc.value.render()


def test_a_base_named_in_a_dockerfile_is_checked_too(project, images, engine_info):
    """COPY --from=${KEY} of a versions.env image counts like a stage's 'from:'."""
    _definition(project, "linux/arm64", images["linux/arm64"])
    d = project / IMG
    (d / "versions.env").write_text((d / "versions.env").read_text() + f"TOOLS_IMAGE={images['linux/amd64']}\n")
    df = d / "Dockerfile.tools"
    df.write_text("ARG PARENT\nARG TOOLS_IMAGE\nFROM ${PARENT}\nARG TOOL_VERSION\n"
                  "COPY --from=${TOOLS_IMAGE} /etc/marker /opt/marker\nCOPY files/tool.sh /opt/tiny/tool.sh\n")
    with pytest.raises(DefinitionError) as exc:
        guards.check_base_platforms(definition.load(project, "tiny"), engine_info)
    assert f"{IMG}/versions.env:13: TOOLS_IMAGE" in exc.value.render()


def test_a_base_that_is_not_local_is_a_note(project, engine_info):
    defn = _definition(project, "linux/arm64", "imagebuild-test/not-here:never")
    (note,) = guards.check_base_platforms(defn, engine_info)
    assert "not local" in note


def test_unreachable_engine_checks_nothing(project):
    from imagebuild.core.engine import EngineInfo

    defn = _definition(project, "linux/arm64", "imagebuild-test/not-here:never")
    assert guards.check_base_platforms(defn, EngineInfo(False, detail="down")) == []
