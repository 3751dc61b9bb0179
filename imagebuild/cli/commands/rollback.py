"""imagebuild rollback: IMAGE:local and IMAGE:previous swapped, in the engine or in the registry."""

from __future__ import annotations

from imagebuild.cli import common, options
from imagebuild.core import lazy
from imagebuild.core.errors import (
    EXIT_OK,
    UsageError,
)
from imagebuild.core.units import short_digest

defn_mod = lazy.module("imagebuild.definition.reader")

EXAMPLES = (
    "imagebuild rollback example",
    "imagebuild rollback example --dry-run",
    "imagebuild rollback example --registry",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("rollback", help="swap IMAGE:local and IMAGE:previous",
                        description="Point IMAGE:local back at IMAGE:previous (what :local was before the last "
                        "promotion); the replaced image becomes IMAGE:previous, so a second rollback undoes the "
                        "first. Exit 1 when there is no :previous; 2 for a name that is not one of the project's "
                        "definitions; 3 while a build or gc of the image holds its build lock.",
                        examples=EXAMPLES)
    options.image_argument(sp, help="image name")
    sp.add_argument("--registry", nargs="?", const="", metavar="HOST:PORT/PREFIX", help="swap the tags in the "
                    "shared registry instead (default: registry: in imagebuild.yaml); the engine is not touched")
    sp.add_argument("--dry-run", action="store_true", help="say which tags would move where; move none")
    options.json_flag(sp, "imagebuild.rollback, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.buildstep import promote as promote_mod

    ctx = common.ctx(args)
    _rollback_target(args.image, ctx)
    if args.registry is not None:
        return _rollback_registry(args, ctx)
    doc = promote_mod.rollback(args.image, ctx, dry_run=args.dry_run)
    if args.json:
        common.print_json(doc)
    else:
        would = "would move " if args.dry_run else ""
        print(f"{args.image}:local    {would}-> {short_digest(doc['local_id'])}"
              + (f"  (from {short_digest(doc['previous_id'])})" if args.dry_run and doc["previous_id"] else ""))
        if doc["previous_id"]:
            print(f"{args.image}:previous {would}-> {short_digest(doc['previous_id'])}")
        if args.dry_run:
            print("dry run: no tag moved")
    return EXIT_OK


def _rollback_target(image: str, ctx) -> None:
    """rollback takes a definition name (it swaps IMAGE:local and IMAGE:previous): not a reference
    (``img:local`` would look for ``img:local:previous``), not a path, not a repository this project
    has no definition of (exit 2, as docs/cli.md says)."""
    if ":" in image or "@" in image:
        name = image.split("@", 1)[0].rsplit(":", 1)[0]
        raise UsageError(f"rollback {image}: expected an image name, not a reference: rollback swaps NAME:local "
                         "and NAME:previous", hint=f"imagebuild rollback {name}")
    defn_mod.check_image_name(image)
    if not (ctx.root / defn_mod.IMAGES_DIR / image / defn_mod.IMAGE_FILE).is_file():
        raise defn_mod.unknown_image(ctx.root, image, note="rollback swaps the tags of this project's images only")


def _rollback_registry(args, ctx) -> int:
    from imagebuild.buildstep import registry_release
    from imagebuild.core import registry as registry_mod

    value = args.registry or ctx.config.registry
    if not value:
        raise UsageError("rollback --registry: which registry? none given and imagebuild.yaml has no registry:",
                         hint="imagebuild rollback IMAGE --registry HOST:PORT/PREFIX")
    reg = registry_mod.parse(value, what="--registry" if args.registry else "imagebuild.yaml: registry")
    doc = registry_release.rollback(reg, args.image, ctx, dry_run=args.dry_run)
    if args.json:
        common.print_json(doc)
    else:
        would = "would move " if args.dry_run else ""
        print(f"{reg.repo(args.image)}:local    {would}-> {short_digest(doc['local_digest'])}  "
              f"(identity {short_digest(doc['local_identity'])})")
        if doc["previous_digest"]:
            print(f"{reg.repo(args.image)}:previous {would}-> {short_digest(doc['previous_digest'])}")
        if args.dry_run:
            print("dry run: no tag moved")
    return EXIT_OK
