"""Step 6, shipping: a gated image -> its peers, sending only what they lack, verified there.

Takes a gated ``<image>:local`` (or a ref and ``--force``) and peer names, and gives each peer the
image under its ``:local``, its identity checked on the peer before the tag moves, with a report
per peer. Entry points:
- ``sync``: ``imagebuild sync`` over ssh (``sync``, ``render``, ``resolve_peers``);
- ``registry_sync``: the delivery through a shared registry (``--via registry``), passed to ``sync``;
- ``peer``: one peer as sync sees it (one ssh connection and the shell agent), also for doctor;
- ``peergc``: keeping a peer's sync cache bounded (``gc --peer``).
"""

__all__ = ["peer", "peergc", "registry_sync", "sync"]
