"""A failed stage's place is said in the stage's own Dockerfile (issue 35, section 1): BuildKit names
the file it got (``<stage>.Dockerfile``, with ``ARG SOURCE_DATE_EPOCH`` after every FROM), whose
line numbers are not the operator's."""

from __future__ import annotations

from imagebuild.buildstep import builder
from imagebuild.buildstep.reproducible import dockerfile_for_build

OWN = "ARG PARENT\nFROM ${PARENT} AS a\nRUN one\nFROM ${PARENT}\nCOPY --from=a /x /x\nRUN two && exit 3\n"


def test_the_place_is_mapped_back_to_the_stages_own_dockerfile(tmp_path):
    own = tmp_path / "Dockerfile.check"
    own.write_text(OWN)
    built = tmp_path / "check.Dockerfile"
    built.write_text(dockerfile_for_build(OWN))
    gen = built.read_text().splitlines()
    n = gen.index("RUN two && exit 3") + 1
    assert n == 8  # two ARG lines were added above it
    shown = "docker-images/img/Dockerfile.check"
    assert builder._source_place(f"check.Dockerfile:{n}", built, own, shown) == f"{shown}:6"
    assert builder._source_place("check.Dockerfile:2", built, own, shown) == f"{shown}:2"  # FROM ... AS a
    assert builder._source_place("check.Dockerfile:4", built, own, shown) == f"{shown}:3"  # RUN one
    # another file, or the inserted line itself: said as BuildKit said it
    assert builder._source_place("other.Dockerfile:3", built, own, shown) == "other.Dockerfile:3"
    assert builder._source_place("check.Dockerfile:3", built, own, shown) == "check.Dockerfile:3"
