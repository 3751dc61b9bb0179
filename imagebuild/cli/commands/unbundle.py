"""imagebuild unbundle: a bundle verified against its lock, then its files put in place (fetch/bundle.py)."""

from __future__ import annotations

from imagebuild.cli import common, options
from imagebuild.core.errors import EXIT_OK
from imagebuild.core.units import human_bytes

EXAMPLES = (
    "imagebuild unbundle example.bundle.tar",
    "imagebuild unbundle example.bundle.tar --json",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("unbundle", help="verify a bundle against its lock, then put its files in place",
                        description="Check FILE's (made by `imagebuild bundle`) headers and manifest before "
                        "writing anything (regular files only, each listed, each of the listed size), stream its "
                        "members into a temporary folder hashing each, verify every file against the bundled "
                        "lock, validate the definition with the bundle's versions.env, and only then move the "
                        "prefetched files, versions.env and lock.json into this project. A bad bundle changes "
                        "nothing (exit 1; 2 when its pins break the definition). After it, `imagebuild build "
                        "IMAGE` needs no network.",
                        examples=EXAMPLES)
    sp.add_argument("file", metavar="FILE", help="the bundle")
    options.json_flag(sp, "imagebuild.bundle-result, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.fetch import bundle as bundle_mod

    res = bundle_mod.unbundle(common.ctx(args), args.file)
    if args.json:
        common.print_json(res.as_dict())
    else:
        print(f"{res.image}: {res.files} files, {human_bytes(res.bytes)} verified and in place; "
              f"`imagebuild build {res.image}` needs no network now")
        for r in res.replaced:
            print(f"  replaced {r} (the bundle's pins)")
        for n in res.notices:
            print(f"  note   {n}")
    return EXIT_OK
