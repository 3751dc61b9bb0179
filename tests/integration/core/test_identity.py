"""Image identity: the same content gives the same digest, independent of the local image id."""

import subprocess

import pytest

from imagebuild.core import identity
from tests.conftest import BUSYBOX

pytestmark = pytest.mark.engine


def _build(tag, dockerfile):
    subprocess.run(["docker", "buildx", "build", "--network", "none", "--load", "-q", "-t", tag, "-"],
                   input=dockerfile.encode(), check=True, capture_output=True)


def test_identity_stable_and_content_sensitive(engine_ready):
    a, b, c = "imagebuild-test/ident:a", "imagebuild-test/ident:b", "imagebuild-test/ident:c"
    try:
        _build(a, f"FROM {BUSYBOX}\nCMD [\"echo\", \"one\"]\n")
        subprocess.run(["docker", "tag", a, b], check=True)
        _build(c, f"FROM {BUSYBOX}\nCMD [\"echo\", \"two\"]\n")
        ia, ib, ic = identity.inspect(a), identity.inspect(b), identity.inspect(c)
        assert ia.digest == ib.digest
        assert ia.layers == ic.layers and ia.digest != ic.digest
        assert ia.digest.startswith("sha256:") and ia.architecture
        # the document does not contain the store-dependent local id
        assert ia.local_id not in str(ia.document())
    finally:
        subprocess.run(["docker", "image", "rm", "-f", a, b, c], capture_output=True)


def test_identity_of_missing_image_is_a_clear_error(engine_ready):
    from imagebuild.core.errors import OperationFailed

    with pytest.raises(OperationFailed, match="not found"):
        identity.inspect("imagebuild-test/does-not-exist:nope")
