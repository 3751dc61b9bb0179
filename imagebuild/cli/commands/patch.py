"""imagebuild patch: an image's patch set applied to, or checked on, a checkout (buildstep/builder.py)."""

from __future__ import annotations

from imagebuild.cli import common, options
from imagebuild.core.errors import EXIT_OK

EXAMPLES = (
    "imagebuild patch glm53-jovian-r12 --src ~/src/vllm --check",
    "imagebuild patch glm53-jovian-r12 --src ~/src/vllm --stage vllm-wheel",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("patch", help="apply or check an image's patch set on a checkout, outside docker",
                        description="Apply IMAGE's patch_*.py files (every stage's, in build order) to the "
                        "source tree DIR with the same primitive the build uses, or with --check only say what "
                        "would happen. Each patch: applied, already-applied, not-needed (upstream has it), "
                        "not-applicable (the code it fixes is not in this tree), would-apply (--check) or failed (naming the patch, file and anchor). Exit 1 when one "
                        "fails. How to write a patch: docs/patches.md.",
                        examples=EXAMPLES)
    options.image_argument(sp)
    sp.add_argument("--src", required=True, metavar="DIR", help="the checkout to patch")
    sp.add_argument("--check", action="store_true", help="change nothing; report what would happen")
    sp.add_argument("--stage", metavar="STAGE", help="only this stage's patches")
    options.json_flag(sp, "imagebuild.patches, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.buildstep import builder as build_mod

    ctx = common.ctx(args)
    try:
        doc = build_mod.patch(ctx, args.image, args.src, check=args.check, stage=args.stage)
    except build_mod.PatchFailed as exc:
        if args.json:
            common.print_json(exc.doc)
        else:
            _print_patches(exc.doc)
        raise
    if args.json:
        common.print_json(doc)
    else:
        _print_patches(doc)
    return EXIT_OK


def _print_patches(doc) -> None:
    for p in doc["patches"]:  # every failing patch's reason, not the first one's alone (the error says that)
        print(f"{p['outcome']:<16} {p['patch']}" + ((f"  ({p['message']})" if p["outcome"] != "failed" else
                                                    f"\n  {p['message']}") if p["message"] else ""))
