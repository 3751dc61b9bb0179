"""imagebuild config: the effective settings and where each came from, and imagebuild's environment."""

from __future__ import annotations

import os

from imagebuild.cli import common, options
from imagebuild.core.errors import (
    EXIT_OK,
    UsageError,
)
from imagebuild.core.printable import printable

EXAMPLES = (
    "imagebuild config",
    "imagebuild config --env",
    "IMAGEBUILD_STAGES=/srv/stages imagebuild config --json",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("config", help="show the effective settings (root, state, stage store, caches, locks, "
                        "peers, registry) and where each came from",
                        description="Print the settings a command would use here: the project root, the state "
                        "folder, the stage store, the caches, the lock folder, the peers and the registry, each "
                        "with its origin (flag, environment, imagebuild.yaml, default) and the flag, variable or "
                        "key it came from; then those of imagebuild's environment variables that are set (--env: "
                        "every one, set or not, with what it does). Secrets are never shown. Reads only. "
                        "Outside a project, the root and state are shown as none.",
                        examples=EXAMPLES)
    sp.add_argument("--env", action="store_true", help="list every environment variable read by imagebuild")
    options.json_flag(sp, "imagebuild.config, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.ops import settings

    env_root = os.environ.get("IMAGEBUILD_ROOT")
    origin = "environment" if env_root and args.root == env_root else "flag" if args.root else "default"
    try:
        root = common.root(args)
    except UsageError:
        if args.root:  # an explicit root that is no project is an error, as for every command
            raise
        root, origin = None, "default"
    from imagebuild.core import config as config_mod

    cfg = config_mod.load(root)
    rows = settings.effective(root, origin, cfg)
    env = settings.environment()
    if args.json:
        common.print_json({"schema": "imagebuild.config", "version": 1, "settings": [r.as_dict() for r in rows],
                           "environment": env if args.env else [e for e in env if e["set"]]})
        return EXIT_OK

    def value(v) -> str:
        if v is None:
            return "none"
        if isinstance(v, list):
            return ", ".join(v) or "none"
        if isinstance(v, dict):
            return "; ".join(f"@{k}: {', '.join(h)}" for k, h in v.items()) or "none"
        return printable(str(v), keep="")

    w = max(len(r.name) for r in rows)
    vw = min(60, max(len(value(r.value)) for r in rows))
    for r in rows:
        print(f"{r.name:<{w}}  {value(r.value):<{vw}}  {r.origin}" + (f" ({r.via})" if r.via else ""))
    listed = env if args.env else [e for e in env if e["set"]]
    print(f"\nenvironment: {sum(e['set'] for e in env)} of the {len(env)} variables imagebuild reads are set"
          + ("" if args.env else " (imagebuild config --env lists them all; docs/cli.md, 'Environment variables')"))
    if listed:
        nw = max(len(e["name"]) for e in listed)
        for e in listed:
            print(f"  {e['name']:<{nw}}  " + (f"= {e['value']}" if e["set"] else f"   {e['what']}"))
    return EXIT_OK
