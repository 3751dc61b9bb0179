"""imagebuild validate: every problem of the image definitions and of imagebuild.yaml (exit 2 if any)."""

from __future__ import annotations

import sys

from imagebuild.cli import common, options
from imagebuild.core import lazy
from imagebuild.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    DefinitionError,
)

defn_mod = lazy.module("imagebuild.definition.reader")

EXAMPLES = (
    "imagebuild validate",
    "imagebuild validate glm53-jovian-r12 --json",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("validate", help="check image definitions and imagebuild.yaml and report every problem",
                        description="Check one or all image definitions, and the project's imagebuild.yaml, and "
                        "report every problem found (file, line or key, what was expected, a hint). Exit 2 if any "
                        "is invalid. JSON Schemas of image.yaml, gate.yaml and imagebuild.yaml for editors: "
                        "docs/schemas/.",
                        examples=EXAMPLES)
    sp.add_argument("images", metavar="IMAGE", nargs="*", help="image names (default: all)")
    options.json_flag(sp, "imagebuild.validate, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    root = common.root(args)
    names = args.images or defn_mod.list_images(root)
    results = []
    for name in names:
        try:
            dfn = defn_mod.load(root, name)
            results.append({"image": name, "valid": True, "problems": [],
                            "unpinned": [n.render() for n in dfn.notices]})
        except DefinitionError as exc:
            results.append({"image": name, "valid": False, "problems": [p.as_dict() for p in exc.problems],
                            "unpinned": []})
            if not args.json:
                print(common.verdicts(exc.render(), sys.stderr), file=sys.stderr)
    for name in [] if args.images else defn_mod.misnamed_images(root):  # never skipped
        exc = DefinitionError([_misnamed_problem(root, name)], image=common.shown_name(name))
        results.append({"image": name, "valid": False, "problems": [p.as_dict() for p in exc.problems],
                        "unpinned": []})
        if not args.json:
            print(common.verdicts(exc.render(), sys.stderr), file=sys.stderr)
    settings = _validate_settings(root, args.json)
    if args.json:
        common.print_json({"schema": "imagebuild.validate", "version": 1, "results": results, "settings": settings})
    else:
        if settings["present"] and settings["valid"]:
            print(f"{settings['file']}: ok")
        for r in results:
            if r["valid"]:
                print(f"{r['image']}: ok" + (f" ({len(r['unpinned'])} unpinned)" if r["unpinned"] else ""))
                for u in r["unpinned"]:
                    print(f"  unpinned: {u}")
    return EXIT_OK if all(r["valid"] for r in results) and settings["valid"] else EXIT_BAD_INPUT


def _misnamed_problem(root, name: str):
    import re

    from imagebuild.core.errors import Problem

    fixed = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._")[:40] or "my-image"
    return Problem(f"{defn_mod.IMAGES_DIR}/{common.shown_name(name)}", "this folder holds an image.yaml but its name "
                   "is no image name (lower-case letters, digits, '.', '_', '-'; at most 100 characters): "
                   "no command can use it", key="IMAGE", hint=f"rename the folder, e.g. to {fixed!r}")


def _validate_settings(root, quiet: bool) -> dict:
    """validate's check of the project's imagebuild.yaml (core/config.py): its problems on stderr."""
    from imagebuild.core import config as config_mod

    doc = {"file": config_mod.CONFIG_FILE, "present": (root / config_mod.CONFIG_FILE).exists(), "valid": True,
           "problems": []}
    try:
        config_mod.load(root)
    except DefinitionError as exc:
        doc.update(valid=False, problems=[p.as_dict() for p in exc.problems])
        if not quiet:
            print(common.verdicts(exc.render(), sys.stderr), file=sys.stderr)
    return doc
