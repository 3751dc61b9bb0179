"""imagebuild sync: the gated image put on peer nodes over ssh or through a registry (ship/sync.py)."""

from __future__ import annotations

import argparse

from imagebuild.cli import common, options
from imagebuild.core import lazy
from imagebuild.core.errors import UsageError

defn_mod = lazy.module("imagebuild.definition.reader")

EXAMPLES = (
    "imagebuild sync dgx4",
    "imagebuild sync --image example --dry-run dgx4 dgx5",
    "imagebuild sync @rack2 --via registry",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("sync", help="put the gated image on peer nodes: only the layers they lack, verified",
                        description="Copy IMAGE:local (or --image REF) to each PEER over ssh: ask the peer which "
                        "layers it holds, send only the missing ones with rsync into its cache (an interrupted "
                        "transfer resumes), load them with the peer's own docker load, check the image's "
                        "store-independent identity there, and only then move the peer's tag (the old :local "
                        "becomes :previous) and carry the gate receipt. Refuses (exit 3) an image without a "
                        "passing receipt of its definition's current gate spec, a peer where a running container "
                        "uses the tag, or a peer without enough disk, unless --force (disk: never). A peer that "
                        "already holds the identity is skipped. Details: docs/sync.md.",
                        epilog="""
sync environment:
  IMAGEBUILD_SSH              the ssh command (default ssh), e.g. 'ssh -F ~/.ssh/cluster_config'
  IMAGEBUILD_SYNC_COMPRESS    auto (default) | none | zstd[:LEVEL]: compression on the wire
  IMAGEBUILD_SYNC_CIPHERS     ssh ciphers preference (default ^aes128-gcm@openssh.com,...; empty: ssh's own)
  IMAGEBUILD_PEER_MIN_FREE_GB disk that must stay free on the peer (default 1)
  IMAGEBUILD_PEER_CACHE       (on the peer) its sync cache (default ~/.cache/imagebuild/peer)
  IMAGEBUILD_SYNC_TUNNEL      --via registry: 1 always through an ssh tunnel, 0 never (default: loopback only)
""", examples=EXAMPLES)
    sp.add_argument("peers", nargs="*", metavar="PEER",
                    help="ssh destinations (dgx4, user@host, an ssh alias) or @LIST (peer_lists: in imagebuild.yaml); "
                    "default: peers: in imagebuild.yaml")
    sp.add_argument("--image", metavar="IMAGE|REF", help="a definition name (its :local) or any image reference "
                    "(default: the project's only definition)")
    options.jobs(sp, help="peers synced in parallel (default 4)")
    sp.add_argument("--force", action="store_true", help="sync an image without a passing receipt, or move a tag a "
                    "running container uses (with a warning)")
    sp.add_argument("--dry-run", action="store_true", help="probe the peers and say what would be sent; change "
                    "nothing")
    sp.add_argument("--via", choices=("ssh", "registry"), default="ssh", help="ssh (default): send the missing "
                    "layers over ssh; registry: push the image once to the shared registry and let each peer's "
                    "engine pull it by digest (only the layers it lacks), then verify and promote as with ssh "
                    "(docs/fleet.md)")
    sp.add_argument("--registry", metavar="HOST:PORT/PREFIX", help="with --via registry: the registry (default: "
                    "registry: in imagebuild.yaml)")
    sp.add_argument("--tunnel", action=argparse.BooleanOptionalAction, default=None, help="with --via registry: "
                    "the peers reach the registry through an ssh -R tunnel on their loopback (default: only when "
                    "the registry is on this host's loopback)")
    options.json_flag(sp, help="print the report as JSON (schema imagebuild.sync, version 1)")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.ship import sync as sync_mod

    ctx = common.ctx_or_none(args)
    reg = None
    if args.via == "registry":
        from imagebuild.core import registry as registry_mod

        value = args.registry or (ctx.config.registry if ctx is not None else None)
        if not value:
            raise UsageError("sync --via registry: which registry? none given and imagebuild.yaml has no registry:",
                             hint="imagebuild sync --via registry --registry HOST:PORT/PREFIX PEER...")
        reg = registry_mod.parse(value, what="--registry" if args.registry else "imagebuild.yaml: registry")
    elif args.registry or args.tunnel is not None:
        raise UsageError("--registry and --tunnel go with --via registry")
    delivery = None
    if reg is not None:
        from imagebuild.ship import registry_sync

        delivery = registry_sync.delivery(reg, args.tunnel)
    sync_mod.image_named_as_peer(ctx, args.peers)
    if args.image is None and ctx is not None and len(defn_mod.list_images(ctx.root)) > 1:
        return _sync_promoted(args, ctx, delivery)
    report = sync_mod.sync(ctx, args.peers, image=args.image, jobs=args.jobs, force=args.force,
                           dry_run=args.dry_run, delivery=delivery)
    if args.json:
        common.print_json(report.as_dict())
    else:
        print(sync_mod.render(report))
    return report.exit_code


def _sync_promoted(args, ctx, delivery) -> int:
    """``imagebuild sync PEER...`` without --image in a project of several definitions: every promoted
    ``:local`` (sync_mod.promoted), one sync each; each report, then one line per definition. The
    exit code is the worst of the syncs; 1 when nothing is promoted."""
    from imagebuild.core.errors import OperationFailed
    from imagebuild.ship import sync as sync_mod

    sync_mod.resolve_peers(ctx, args.peers)  # exit 2 for no peer, before any image is looked at
    rows, reports = [], []
    for name, why in sync_mod.promoted(ctx):
        if why is not None:
            rows.append((name, "skipped", why))
            continue
        report = sync_mod.sync(ctx, args.peers, image=name, jobs=args.jobs, force=args.force,
                               dry_run=args.dry_run, delivery=delivery)
        reports.append(report)
        if not args.json:
            print(sync_mod.render(report) + "\n")
        peers = ", ".join(f"{p.peer} {p.status}" for p in report.peers)
        rows.append((name, "ok" if report.ok else "not synced", f"{report.ref}: {peers}"))
    if not reports:
        raise OperationFailed("nothing to sync: no definition of this project has a promoted :local here ("
                              + "; ".join(f"{n}: {w}" for n, _, w in rows) + ")",
                              hint="imagebuild build IMAGE (it promotes a gated build), or imagebuild sync "
                              "--image IMAGE|REF PEER")
    code = max(r.exit_code for r in reports)
    if args.json:
        common.print_json({"schema": "imagebuild.sync-promoted", "version": 1, "exit_code": code,
                           "images": [{"image": n, "status": st, "detail": d} for n, st, d in rows],
                           "reports": [r.as_dict() for r in reports]})
        return code
    for name, st, detail in rows:
        print(f"{name}: {st}: {detail}")
    return code
