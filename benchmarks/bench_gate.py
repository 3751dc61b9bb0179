"""gate: `imagebuild gate` on a small Debian image (8 checks: metadata, import, version, expression,
file, elf, command, one GPU check skipped), against a shell script doing the same checks the plain
way: `docker image inspect` plus one `docker run --rm` per check.

Ours includes everything the command does: CLI start, identity, one container, pytest + testinfra,
log and receipt. The acceptance bound is < 10 s.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from harness import Benchmark, sh

ROOT = Path(__file__).resolve().parents[1]
REF = f"imagebuild-bench/gate:p{os.getpid()}"
_TMP: dict[str, Path] = {}

DOCKERFILE = """\
FROM imagebuild-test/debian:bookworm
RUN set -e; d=/usr/lib/python3/dist-packages; mkdir -p $d/gatedemo-1.2.3.dist-info /opt/native /opt/gatedemo; \\
    printf 'Metadata-Version: 2.1\\nName: gatedemo\\nVersion: 1.2.3\\n' > $d/gatedemo-1.2.3.dist-info/METADATA; \\
    printf 'import enum\\nclass Backend(enum.Enum):\\n    B12X = 1\\n' > $d/gatedemo.py; \\
    cp /usr/lib/*-linux-gnu/libc.so.6 /opt/native/libdemo.so; \\
    echo '# imagebuild-patch: sm121 applied' > /opt/gatedemo/patched.py
LABEL org.opencontainers.image.title=gatedemo
"""

SPEC = """\
checks:
  - {id: title, kind: metadata, labels: {org.opencontainers.image.title: gatedemo}}
  - {id: import, kind: import, module: gatedemo}
  - {id: version, kind: version, distribution: gatedemo, specifier: ">=1.2,<2"}
  - {id: enum, kind: expression, imports: [gatedemo], expr: "'B12X' in gatedemo.Backend.__members__"}
  - {id: marker, kind: file, path: /opt/gatedemo/patched.py, contains: "imagebuild-patch: sm121"}
  - {id: elf, kind: elf, path: /opt/native, machine: MACHINE}
  - {id: python, kind: command, run: python3 --version, stdout: '^Python 3'}
  - {id: capability, kind: expression, requires: gpu, expr: "False"}
"""

# The same checks, the way a shell script does them: one container per check.
BASELINE = r"""
set -e
img=$1; m=$2
docker image inspect --format '{{index .Config.Labels "org.opencontainers.image.title"}}' "$img" | grep -qx gatedemo
r() { docker run --rm --network none --entrypoint "" "$img" "$@"; }
r python3 -c 'import gatedemo'
r python3 -c 'import importlib.metadata as m; v = m.version("gatedemo"); assert v.startswith("1."), v'
r python3 -c 'import gatedemo, sys; sys.exit(0 if "B12X" in gatedemo.Backend.__members__ else 1)'
r grep -q 'imagebuild-patch: sm121' /opt/gatedemo/patched.py
r python3 -c 'import sys; h = open("/opt/native/libdemo.so", "rb").read(20); sys.exit(0 if h[:4] == b"\x7fELF" and int.from_bytes(h[18:20], "little") == int(sys.argv[1]) else 1)' "$m"
r python3 --version | grep -q '^Python 3'
"""


def _machine() -> tuple[str, str]:
    arch = os.uname().machine
    return ("aarch64", "183") if arch in ("aarch64", "arm64") else ("x86_64", "62")


def _setup():
    tmp = Path(tempfile.mkdtemp(prefix="bench-gate-"))
    _TMP["dir"] = tmp
    (tmp / "ctx").mkdir()
    (tmp / "ctx" / "Dockerfile").write_text(DOCKERFILE)
    sh("docker", "buildx", "build", "--network", "none", "--load", "-q", "-t", REF, str(tmp / "ctx"))
    (tmp / "gate.yaml").write_text(SPEC.replace("MACHINE", _machine()[0]))


def _teardown():
    sh("docker", "image", "rm", "-f", REF)
    shutil.rmtree(_TMP.pop("dir"), ignore_errors=True)


def _ours():
    tmp = _TMP["dir"]
    env = dict(os.environ, IMAGEBUILD_STATE_DIR=str(tmp / "state"), IMAGEBUILD_NO_GPU="1")
    sh(sys.executable, "-m", "imagebuild", "-q", "gate", REF, "--spec", str(tmp / "gate.yaml"), env=env,
       cwd=str(ROOT))


def _baseline():
    sh("bash", "-c", BASELINE, "_", REF, _machine()[1])


def benchmarks():
    return [Benchmark("gate small image (8 checks, 1 GPU skipped)", _ours, _baseline, repeat=3,
                      setup=_setup, teardown=_teardown,
                      note="baseline: docker image inspect + one docker run --rm per check; bound: ours < 10 s")]
