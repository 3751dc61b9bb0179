"""imagebuild doctor: this host's checks (engine, BuildKit, disk, tools, peers), one line each."""

from __future__ import annotations

from imagebuild.cli import common, options
from imagebuild.core import lazy
from imagebuild.core.errors import (
    EXIT_FAILED,
    EXIT_OK,
    ImagebuildError,
)

doctor_mod = lazy.module("imagebuild.ops.doctor")

EXAMPLES = (
    "imagebuild doctor",
    "imagebuild doctor --peer dgx4 --json",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("doctor", help="check this host: engine, BuildKit, image store, disk, memory, tools, "
                        "peers",
                        description="Check that this host can build and ship images: Docker engine "
                        "reachable, buildx and BuildKit versions and the selected builder, containerd image store, "
                        "free disk and memory, git, rsync, ssh, skopeo, the NVIDIA container runtime (a warning "
                        "when absent: the gate's GPU checks are then skipped), and each peer reachable with its own engine. Says what to "
                        "do about each problem. Exit 1 if any check fails (warnings do not fail).",
                        examples=EXAMPLES)
    sp.add_argument("--peer", action="append", default=[], metavar="HOST",
                    help="also check this SSH peer (repeatable; user@host works)")
    options.json_flag(sp, "imagebuild.doctor, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    try:
        ctx = common.ctx(args)
    except ImagebuildError:
        ctx = None  # doctor checks the host also outside a project, even with a bad --root
    checks = doctor_mod.run_checks(ctx, peers=args.peer)
    if args.json:
        common.print_json({"schema": "imagebuild.doctor", "version": 1, "checks": [c.as_dict() for c in checks]})
    else:
        w = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.status.upper():<4}  {c.name:<{w}}  {c.detail}")
            if c.fix and c.status != "ok":
                print(f"{'':<4}  {'':<{w}}  -> {c.fix}")
    return EXIT_FAILED if any(c.status == "fail" for c in checks) else EXIT_OK
