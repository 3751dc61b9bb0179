"""imagebuild bundle: an image's lock and prefetched files in one verified file (fetch/bundle.py)."""

from __future__ import annotations

from imagebuild.cli import common, options
from imagebuild.core import lazy
from imagebuild.core.errors import EXIT_OK
from imagebuild.core.units import human_bytes

defn_mod = lazy.module("imagebuild.definition.reader")

EXAMPLES = (
    "imagebuild bundle example -o example.bundle.tar",
    "imagebuild bundle example -o /media/usb/example.tar --json",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("bundle", help="pack an image's lock and every prefetched file into one verified file "
                        "for a node without GitHub access",
                        description="Write one file holding IMAGE's lock.json and versions.env, every source "
                        "tarball, wheel and deb the lock names (each checked against the lock while it is "
                        "written), a SHA256SUMS and a manifest. Carry it to the build node and run `imagebuild "
                        "unbundle FILE` there. Details: docs/prefetch.md (\"Carry it to an air-gapped node\").",
                        examples=EXAMPLES)
    options.image_argument(sp)
    sp.add_argument("-o", "--output", required=True, metavar="FILE", help="the bundle to write (a tar)")
    options.json_flag(sp, "imagebuild.bundle-result, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.core.fsutil import check_output_file
    from imagebuild.fetch import bundle as bundle_mod

    ctx = common.ctx(args)
    defn_mod.check_image_name(args.image)
    res = bundle_mod.bundle(ctx, args.image, check_output_file(args.output, "-o/--output"))
    if args.json:
        common.print_json(res.as_dict())
    else:
        print(f"{res.image}: {res.files} files, {human_bytes(res.bytes)} -> {res.file}")
    return EXIT_OK
