"""glm53-jovian-r12's RDMA check (gate.yaml, `rdma-verbs`), run by `imagebuild gate` in real containers of
three tiny images: libibverbs with the mlx5 provider passes; libibverbs without a provider (what apt's
libibverbs1 + rdma-core give with --no-install-recommends: no device, NCCL on sockets) fails; no
libibverbs at all fails. The libraries are empty shared objects compiled in the image with their real
sonames and laid out where Debian's and Ubuntu's libibverbs1 and ibverbs-providers put them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from imagebuild.gate import runner as gate
from tests.conftest import DEBIAN, run_cli

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[3]
TAG = f"imagebuild-test/rdma:t{os.getpid()}"

DOCKERFILE = f"""\
FROM {DEBIAN} AS verbs
RUN set -e; lib=$(dirname $(readlink -f /usr/lib/*-linux-gnu/libc.so.6)); \\
    echo 'int ibv_get_device_list;' | gcc -shared -fPIC -Wl,-soname,libibverbs.so.1 -x c - -o $lib/libibverbs.so.1.14.0; \\
    ldconfig
FROM verbs AS provider
RUN set -e; lib=$(dirname $(readlink -f /usr/lib/*-linux-gnu/libc.so.6)); mkdir -p $lib/libibverbs /etc/libibverbs.d; \\
    echo 'int mlx5dv_query_device;' | gcc -shared -fPIC -Wl,-soname,libmlx5.so.1 -x c - -o $lib/libmlx5.so.1.24.0; \\
    ln -s ../libmlx5.so.1.24.0 $lib/libibverbs/libmlx5-rdmav34.so; echo 'driver mlx5' > /etc/libibverbs.d/mlx5.driver; \\
    ldconfig
"""


@pytest.fixture(scope="module")
def images(engine_info, tmp_path_factory):
    ctx = tmp_path_factory.mktemp("rdma")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    refs = {"verbs": f"{TAG}-verbs", "provider": f"{TAG}-provider"}
    for target, ref in refs.items():
        subprocess.run(["docker", "buildx", "build", "--network", "none", "--load", "-q", "--target", target,
                        "-t", ref, str(ctx)], check=True, capture_output=True)
    yield {"none": DEBIAN, **refs}
    subprocess.run(["docker", "image", "rm", "-f", *refs.values()], capture_output=True)


@pytest.fixture
def spec(tmp_path, monkeypatch) -> Path:
    """glm53's own rdma-verbs check, as its gate.yaml has it, alone in a spec."""
    monkeypatch.setenv("IMAGEBUILD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv(gate.NO_GPU_ENV, "1")
    doc = yaml.safe_load((REPO / "docker-images" / "glm53-jovian-r12" / "gate.yaml").read_text())
    (check,) = [c for c in doc["checks"] if c["id"] == "rdma-verbs"]
    p = tmp_path / "rdma.yaml"
    p.write_text(yaml.safe_dump({"checks": [check]}))
    return p


@pytest.mark.parametrize("which, code, detail", [
    ("provider", 0, "PASSED: 1 passed"),
    ("verbs", 4, r"stdout does not match /libmlx5\.so\.1 /"),
    ("none", 4, r"stdout does not match /libibverbs\.so\.1 /"),
])
def test_rdma_check_needs_the_provider(images, spec, which, code, detail):
    r = run_cli("gate", images[which], "--spec", str(spec))
    assert r.code == code, r.err + r.out
    assert detail in r.out + r.err
    if which == "verbs":  # every part of the provider is named
        for part in (r"/^provider libmlx5-rdmav\d+\.so$/", "/^driver mlx5$/"):
            assert part in r.out + r.err
