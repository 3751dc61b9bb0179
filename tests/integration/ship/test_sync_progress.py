"""What `imagebuild sync` shows while it works (issue 23, section 1): no opening "sent 16 B of
235.8 MB (0%)", progress lines that say how far the transfer got, and a line while the peer loads
the image (the heartbeat of the sync steps, IMAGEBUILD_SYNC_HEARTBEAT). The real peer (tests/peers.py)."""

from __future__ import annotations

import re

import pytest

from tests.syncfixtures import (  # noqa: F401 - fixtures
    _private_sync_cache,
    env,
    reset,
    sync,
    sync_images_fixture,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_sync_progress_says_how_far_it_got_and_that_the_load_runs(sync_images, peer):
    imgs = sync_images
    reset(peer)
    imgs.set_local(imgs.big)  # a 300 MB layer: rsync and the load take seconds
    with env(IMAGEBUILD_SYNC_HEARTBEAT="0.2"):
        r, doc = sync(imgs, peer, peer.addr)
    assert r.code == 0, r.err
    sent = [ln for ln in r.err.splitlines() if re.search(r": sent \S+ \S+ of ", ln)]
    assert sent, r.err
    # every progress line says how far the transfer got; the last one that it is done
    for ln in sent:
        m = re.search(r"sent (\S+) (\S+) of \S+ \S+ \((\d+)%\)", ln)
        assert m and int(m.group(3)) > 0 and m.group(2) != "B", ln
    assert "(100%)" in sent[-1]
    lines = r.err.splitlines()
    i = next(i for i, ln in enumerate(lines) if ": loading on the peer" in ln)
    beats = [ln for ln in lines[i + 1:] if re.search(r": still loading on the peer: .* so far", ln)]
    assert beats, r.err
