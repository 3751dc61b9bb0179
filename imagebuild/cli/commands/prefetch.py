"""imagebuild prefetch: pin the git sources, pack the tarballs, write the lock (fetch/prefetch.py)."""

from __future__ import annotations

import sys

from imagebuild.cli import common, options
from imagebuild.core import lazy

defn_mod = lazy.module("imagebuild.definition.reader")

EXAMPLES = (
    "imagebuild prefetch example",
    "imagebuild prefetch example --refresh-source VLLM --dry-run",
    "imagebuild prefetch --offline",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("prefetch", help="pin git sources by SHA, compose forks, pack deterministic tarballs, "
                        "write the lock",
                        description="Fetch every git source of the images into a local mirror cache (only what "
                        "is missing, by raw commit SHA), pin bare PR numbers and ref names to SHAs in "
                        "versions.env (in place), compose each fork (ref + PR heads merged in order, fixed "
                        "identity and date), check the FetchContent dependencies its CMake files declare, pack "
                        "deterministic tarballs into deps-src/IMAGE/src/ with a SHA256SUMS, and write the "
                        "lock's 'sources' section (the build id). A re-run when nothing changed runs no git "
                        "at all. On failure the previous lock and tarballs are left as they were. "
                        "--refresh moves every source; --refresh-source NAME (repeatable, or NAME,NAME) only those. "
                        "--dry-run resolves and says what it would write to versions.env and the lock, and writes "
                        "neither. Details: docs/prefetch.md.",
                        epilog="""
prefetch environment:
  IMAGEBUILD_CACHE         mirror cache folder (default $XDG_CACHE_HOME/imagebuild/git,
                           else ~/.cache/imagebuild/git); --cache overrides it
  IMAGEBUILD_GIT_RETRIES   attempts per network git operation (default 5)
  IMAGEBUILD_RETRY_DELAY   first backoff delay in seconds, doubling (default 1)
  IMAGEBUILD_GIT_TIMEOUT   seconds per git network attempt (default 1800)
  GITHUB_TOKEN             optional: GitHub API token to report PR states (never logged)
""", examples=EXAMPLES)
    sp.add_argument("images", nargs="*", metavar="IMAGE",
                    help="image definitions to prefetch (default: every image with git sources)")
    sp.add_argument("--refresh", action="store_true",
                    help="re-resolve pinned PR heads and followed branches (NAME_REF=<branch>@<sha>) of every source "
                    "and report which moved")
    sp.add_argument("--refresh-source", action="append", metavar="NAME", default=[],
                    help="refresh only this git source (repeatable; NAME,NAME works; --refresh=NAME is the old "
                    "spelling)")
    sp.add_argument("--dry-run", action="store_true", help="resolve, and print the versions.env pins and lock "
                    "sources it would write; write neither, fetch no tarball")
    sp.add_argument("--offline", action="store_true",
                    help="use the mirror cache only; fail naming the first missing object")
    options.jobs(sp, help="parallel git operations (default 4)")
    sp.add_argument("--cache", metavar="DIR", help="mirror cache folder (default: $IMAGEBUILD_CACHE, else "
                    "$XDG_CACHE_HOME/imagebuild/git)")
    options.json_flag(sp, "imagebuild.prefetch, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    import re

    from imagebuild.fetch import prefetch as prefetch_mod

    ctx = common.ctx(args)
    if args.refresh:  # the old `--refresh NAME...`: a source name is upper case, an image name never is
        old = [n for n in args.images if re.fullmatch(r"[A-Z][A-Z0-9_]*", n)]
        if old:
            print(f"warning: --refresh {' '.join(old)}: taken as --refresh-source {','.join(old)} (the old "
                  "spelling, deprecated: --refresh takes no value now)", file=sys.stderr)
            args.images = [n for n in args.images if n not in old]
            args.refresh_source = [*args.refresh_source, *old]
    for name in args.images:
        defn_mod.check_image_name(name)
    named = [n for v in args.refresh_source for n in v.split(",") if n]
    refresh = named if named else ([] if args.refresh else None)
    report = prefetch_mod.prefetch(ctx, args.images or None, refresh=refresh, offline=args.offline,
                                   jobs=args.jobs, cache_dir=args.cache, dry_run=args.dry_run)
    if args.json:
        common.print_json(report.as_dict())
    else:
        print(prefetch_mod.render(report))
    return report.exit_code
