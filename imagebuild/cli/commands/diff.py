"""imagebuild diff: what changed between two built images (ops/imagediff.py)."""

from __future__ import annotations

from imagebuild.cli import common, options
from imagebuild.core.errors import (
    EXIT_OK,
    ImagebuildError,
    UsageError,
)

EXAMPLES = (
    "imagebuild diff example:previous example:local",
    "imagebuild diff example:previous example:local --json",
)


def add_parser(sub) -> None:
    sp = sub.add_parser(
        "diff", help="what changed between two built images: pins, patches, packages, layers",
        description="Compare two images the engine holds (any references: IMAGE:local, IMAGE:previous, "
        "IMAGE:b-<build id>, an id): the pins and patch outcomes they carry (/opt/imagebuild), their Python "
        "distributions and dpkg packages, and their layers with sizes. Starts no process in either image when "
        "the lists are baked in; otherwise lists Python distributions in a throwaway --network none container.",
        examples=EXAMPLES)
    sp.add_argument("ref1", metavar="REF1", help="the older image")
    sp.add_argument("ref2", metavar="REF2", help="the newer image")
    sp.add_argument("--limit", type=options.count(1, 1_000_000), default=50, metavar="N", help="show at most N rows per section (default 50)")
    options.json_flag(sp, "imagebuild.image-diff, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.ops import imagediff

    for name, value in (("REF1", args.ref1), ("REF2", args.ref2)):
        if not value or value.startswith("-") or not value.isprintable() or any(c.isspace() for c in value):
            raise UsageError(f"{name} {value!r}: expected an image reference (IMAGE:TAG, an id), not an option "
                             "or an empty word", hint="imagebuild diff IMAGE:previous IMAGE:local")

    try:
        ctx = common.ctx(args)
    except ImagebuildError:  # two references can be compared outside a project (no inventory cache then)
        ctx = None
    a = imagediff.inventory(args.ref1, ctx)
    b = imagediff.inventory(args.ref2, ctx)
    d = imagediff.diff(a, b)
    if args.json:
        common.print_json(d)
    else:
        print(imagediff.render(d, limit=args.limit))
    return EXIT_OK
