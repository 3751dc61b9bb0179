"""imagebuild gc: what no kept build needs removed, here or in a peer's sync cache (ops/gc.py, ship/peergc.py)."""

from __future__ import annotations

from imagebuild.cli import common, options
from imagebuild.core.errors import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
)

EXAMPLES = (
    "imagebuild gc --dry-run",
    "imagebuild gc example --keep 1",
    "imagebuild gc --peer dgx4 --dry-run",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("gc", help="free disk: remove what no kept build needs (--dry-run first)",
                        description="Remove, per image, what no kept build needs: release images and tags of other "
                        "builds, stage-store stages and blobs, prefetched tarballs no kept lock names, package "
                        "folders of removed stages, old run records, temporary folders of runs that died, and "
                        "*.tmp folders a killed prefetch left in the git mirror cache. Kept: the builds IMAGE:local, "
                        ":previous and :candidate point at, the last N builds (--keep), and every image a container "
                        "uses; each with its stages, release image, prefetched files and records, so it still "
                        "rebuilds as a no-op. Only this checkout's builds: what another clone built into the shared stage "
                        "store stays. gc holds each image's build lock while it plans and removes (exit 3 while a "
                        "build, rollback or gc of it runs); an image this checkout does not know is exit 2. "
                        "Retention: docs/build.md, 'Disk'.",
                        examples=EXAMPLES)
    options.image_argument(sp, nargs="?", help="image name (default: every image of the project)")
    sp.add_argument("--keep", type=options.count(0, 100_000), default=None, metavar="N", help="also keep the last N builds (default 3; "
                    "with --peer: the records and receipts of the last N synced images, default 5)")
    sp.add_argument("--dry-run", action="store_true", help="remove nothing; list what would go and the bytes freed")
    sp.add_argument("--peer", action="append", default=[], metavar="PEER",
                    help="clean PEER's sync cache instead (repeatable): interrupted transfers older than a day, "
                    "blobs no pending sync needs, staging images, leaked containerd leases of interrupted loads, "
                    "records and receipts beyond the last --keep images (docs/sync.md)")
    options.json_flag(sp, help="print JSON (schema imagebuild.gc, version 1; with --peer: "
                      "imagebuild.gc-peer)")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.ops import gc as gc_mod

    if args.peer:
        return _cmd_gc_peer(args)
    if args.keep is None:
        args.keep = gc_mod.DEFAULT_KEEP
    ctx = common.ctx(args)
    if args.keep < 0:
        raise UsageError(f"--keep {args.keep}: expected 0 or more")
    if args.image:  # an unknown image: exit 2 before the engine is asked
        gc_mod.check_known(ctx, args.image)
    if not args.dry_run:  # a gate killed with -9 left its container: its build is not "used by a container"
        from imagebuild.gate import leftovers

        leftovers.reap()
    # a busy image (its build lock held by a build, rollback or gc): exit 3, nothing removed
    plan = gc_mod.collect(ctx, args.image, args.keep, dry_run=args.dry_run)
    if args.json:
        common.print_json(plan.as_dict(args.dry_run))
        return EXIT_OK
    h = gc_mod.human
    verb = "would remove" if args.dry_run else "removed"
    for ip in plan.images:
        kept = ", ".join(f"{b} ({why})" for b, why in ip.kept_builds.items()) or "none"
        print(f"{ip.image}: keeping builds {kept}")
        for it in ip.remove:
            print(f"  {verb:<12} {it.kind:<12} {it.what}  {h(it.bytes)}  ({it.why})")
        for sk in ip.skipped:
            print(f"  left alone   {sk}")
        print(f"  {ip.image}: {h(ip.freed)} {'to free' if args.dry_run else 'freed'}")
    for it in plan.shared:
        print(f"{verb:<12} {it.kind:<12} {it.what}  {h(it.bytes)}  ({it.why})")
    print(f"total: {h(plan.freed)} {'would be freed' if args.dry_run else 'freed'}")
    return EXIT_OK


def _cmd_gc_peer(args) -> int:
    from imagebuild.ship import peergc

    if args.image:
        raise UsageError("gc --peer cleans a peer's sync cache: it takes no IMAGE")
    keep = peergc.DEFAULT_KEEP if args.keep is None else args.keep
    if keep < 0:
        raise UsageError(f"--keep {keep}: expected 0 or more")
    results = [peergc.gc_peer(host, keep=keep, dry_run=args.dry_run) for host in dict.fromkeys(args.peer)]
    if args.json:
        common.print_json({"schema": "imagebuild.gc-peer", "version": 1, "dry_run": args.dry_run,
                     "peers": [r.as_dict() for r in results]})
    else:
        for r in results:
            print(peergc.render(r, args.dry_run))
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAILED
