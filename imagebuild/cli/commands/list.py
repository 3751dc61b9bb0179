"""imagebuild list: the image definitions under docker-images/, each with its platform and stages or INVALID."""

from __future__ import annotations

import os

from imagebuild.cli import common, options
from imagebuild.core import lazy
from imagebuild.core.errors import (
    EXIT_OK,
    DefinitionError,
)

defn_mod = lazy.module("imagebuild.definition.reader")

EXAMPLES = (
    "imagebuild list",
    "imagebuild list --json",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("list", help="list the image definitions under docker-images/",
                        description="List the image definitions under docker-images/ with their platform, "
                        "stages and whether each one is valid. Reads only.",
                        examples=EXAMPLES)
    options.json_flag(sp, "imagebuild.list, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    root = common.root(args)
    rows = []
    for name in defn_mod.list_images(root):
        try:
            dfn = defn_mod.load(root, name)
            rows.append({"name": name, "valid": True, "platform": dfn.platform,
                         "stages": [s.name for s in dfn.stages], "description": dfn.description,
                         "unpinned": len(dfn.notices), "problems": 0})
        except DefinitionError as exc:
            rows.append({"name": name, "valid": False, "platform": None, "stages": [], "description": None,
                         "unpinned": 0, "problems": len(exc.problems)})
    for name in defn_mod.misnamed_images(root):  # listed INVALID, never skipped
        rows.append({"name": name, "valid": False, "platform": None, "stages": [], "description": None,
                     "unpinned": 0, "problems": 1})
    if args.json:
        common.print_json({"schema": "imagebuild.list", "version": 1, "images": rows})
        return EXIT_OK
    if not rows:
        print(f"no image definitions in {defn_mod.display_path(os.getcwd() and root, root / 'docker-images')}")
        return EXIT_OK
    w = max(len(r["name"]) for r in rows)
    for r in rows:
        if r["valid"]:
            extra = f", {r['unpinned']} unpinned" if r["unpinned"] else ""
            print(f"{r['name']:<{w}}  {r['platform']:<12} {len(r['stages'])} stages ({' -> '.join(r['stages'])})"
                  f"{extra}")
        elif not defn_mod.NAME_RE.match(r["name"]):
            shown = common.shown_name(r["name"])
            print(f"{shown:<{w}}  INVALID      the folder name is no image name: imagebuild validate")
        else:
            print(f"{r['name']:<{w}}  INVALID      {r['problems']} problem(s): imagebuild validate {r['name']}")
    return EXIT_OK
