"""imagebuild build: an image's stages built offline up to :candidate, gated, promoted (buildstep/builder.py)."""

from __future__ import annotations

from imagebuild.cli import common, options
from imagebuild.core import lazy
from imagebuild.core.errors import (
    EXIT_FAILED,
    EXIT_OK,
    GateFailed,
    UsageError,
)
from imagebuild.core.units import short_digest

log = lazy.logger()

EXAMPLES = (
    "imagebuild build example",
    "imagebuild build example --dry-run",
    "imagebuild build example --until wheel --no-gate",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("build", help="build an image's stages offline, cached by key, up to :candidate (and "
                        ":local after its gate passes)",
                        description="Run IMAGE's plan: each stage built with BuildKit FROM its parent, tagged "
                        "with its cache key, skipped when that image exists; every stage under --network none "
                        "unless it declares network: true; prefetched sources checked against the lock and "
                        "bind-mounted as named build contexts. Then the release image (labels, lock, build "
                        "record) tagged IMAGE:b-<build id> and IMAGE:candidate; when the definition has a gate "
                        "spec, the gate runs and IMAGE:local moves only on a passing receipt (the old :local "
                        "becomes :previous). Refuses (exit 3) on a foreign platform, while a serving container "
                        "runs, on low disk, or while another build of IMAGE runs. Logs: "
                        ".imagebuild/builds/IMAGE/BUILD-ID/logs/. Details: docs/build.md.",
                        examples=EXAMPLES)
    options.image_argument(sp)
    sp.add_argument("--from", dest="from_stage", metavar="STAGE",
                    help="start at STAGE (earlier stage images must exist)")
    sp.add_argument("--until", dest="until_stage", metavar="STAGE",
                    help="stop after STAGE (no release image, no promotion unless STAGE is the last)")
    sp.add_argument("--no-cache", action="store_true",
                    help="rebuild the selected stages even when their images exist, without BuildKit's cache")
    sp.add_argument("--force", action="store_true",
                    help="build even while a serving container runs or disk is low (with a warning)")
    sp.add_argument("--emulate", action="store_true",
                    help="allow a target platform other than the host's (QEMU emulation; slow)")
    sp.add_argument("--dry-run", action="store_true", help="check everything and print what would run; build "
                    "nothing")
    sp.add_argument("--jobs", "-j", type=options.count(1, 4096), metavar="N", help="MAX_JOBS for stages that declare it (default: from "
                    "free memory and cores, see docs/build.md)")
    options.progress(sp, help="tty: a live line per stage and step with timers and their last output lines; plain: "
                     "a line per step, and a heartbeat every 30 s (the running step, its time, its last output "
                     "line); quiet: only the heartbeat; rawjson: BuildKit's own JSON lines; auto: tty on a "
                     "terminal, otherwise plain (default: $IMAGEBUILD_PROGRESS, then $BUILDKIT_PROGRESS, then "
                     "auto). Every stage's full log is in its log file whatever is shown")
    sp.add_argument("--no-gate", action="store_true", help="stop at IMAGE:candidate even if a gate spec exists")
    sp.add_argument("--check-repro", action="store_true", help="prove the selected stages reproducible: build "
                    "them (as build does), then each once more from the same parent without BuildKit's cache, "
                    "and compare; names every file that differs; no release, no promotion; exit 1 on a "
                    "difference (docs/build.md, Reproducibility)")
    sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="this run only: give the build arg KEY (declared by a stage, from versions.env or a "
                    "default) the value VALUE; a different key and build id, recorded in the build record; "
                    "the build is gated but never promoted to :local without --promote-set (repeatable)")
    sp.add_argument("--promote-set", action="store_true", help="with --set: promote the build to :local when its "
                    "gate passes")
    sp.add_argument("--cache-registry", metavar="HOST:PORT/PREFIX", help="a registry shared by the build nodes: "
                    "stages found there under their key are pulled (verified) instead of built, stages built here "
                    "are pushed, and the gated release is tagged there (default: registry: in imagebuild.yaml)")
    sp.add_argument("--no-cache-registry", action="store_true", help="ignore the registry of imagebuild.yaml")
    sp.add_argument("--engine", metavar="ssh://HOST|CONTEXT", help="build on that engine: every engine call (guards, "
                    "BuildKit, release, tags, gate) goes there; its node's memory, cores and disk are used "
                    "(docs/fleet.md)")
    options.json_flag(sp, help="print the build record (schema imagebuild.build, "
                      "version 2; with --dry-run: schema imagebuild.build-plan, version 2)")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.core import remote_engine

    engine = remote_engine.resolve(args.engine) if args.engine is not None else None
    with remote_engine.use(engine):
        return _cmd_build(args)


def _overrides(values: list[str]) -> dict[str, str]:
    """``--set KEY=VALUE`` (repeatable) -> {KEY: VALUE}; a word without ``=``, an empty KEY or a KEY given
    twice is a usage error (exit 2). Which KEYs a definition takes: planner.check_overrides."""
    out: dict[str, str] = {}
    for v in values:
        key, eq, value = v.partition("=")
        if not eq or not key or not key.replace("_", "").isalnum():
            raise UsageError(f"--set {v!r}: expected KEY=VALUE (a build arg's name, then its value)",
                             hint="imagebuild build IMAGE --set TOOL_VERSION=1.1")
        if key in out:
            raise UsageError(f"--set {key}: given twice")
        out[key] = value
    return out


def _cmd_build(args) -> int:
    from imagebuild.buildstep import builder as build_mod

    ctx = common.ctx(args)
    if args.cache_registry and args.no_cache_registry:
        raise UsageError("--cache-registry and --no-cache-registry cannot be used together")
    registry = None if args.no_cache_registry else (args.cache_registry or ctx.config.registry)
    if args.check_repro and args.cache_registry:
        raise UsageError("--check-repro proves what this host builds: it pulls no stage from a registry",
                         hint="leave out --cache-registry")
    if args.check_repro:
        registry = None
    if registry:
        from imagebuild.core import registry as registry_mod

        registry_mod.parse(registry, what="--cache-registry" if args.cache_registry else "imagebuild.yaml: registry")
    opts = build_mod.Options(from_stage=args.from_stage, until_stage=args.until_stage, no_cache=args.no_cache,
                             force=args.force, dry_run=args.dry_run, jobs=args.jobs, emulate=args.emulate,
                             gate=not args.no_gate, progress=args.progress, registry=registry,
                             check_repro=args.check_repro, overrides=_overrides(args.overrides),
                             promote_set=args.promote_set)
    if args.dry_run and args.check_repro:
        raise UsageError("--check-repro builds every selected stage twice; --dry-run builds nothing",
                         hint="use one of them")
    if args.dry_run:
        doc = build_mod.dry_run(ctx, args.image, opts)
        if args.json:
            common.print_json(doc)
        else:
            print(f"image     {doc['image']}  ({doc['platform']}, build id {doc['build_id']}, "
                  f"SOURCE_DATE_EPOCH {doc['source_date_epoch']})")
            import shlex

            print(f"stages    {doc['stage_store']} (OCI layout; each stage's file times clamped to its SOURCE_DATE_EPOCH)")
            for i, s in enumerate(doc["stages"], start=1):
                print(f"{i}. {s['name']:<16} {s['action']:<14} {s['image']}  ({s['reason']}; network {s['network']})")
                if s["command"]:
                    print("   " + shlex.join(s["command"]))
            print("then: release image, :b-<build id>, :candidate" if doc["release"] else
                  "then: stop (--until), no release image")
        return EXIT_OK
    try:
        rec = build_mod.build(ctx, args.image, opts)
    except GateFailed as exc:  # exit 4, and --json still prints the run's record
        if args.json and isinstance(getattr(exc, "record", None), dict):
            common.print_json(exc.record)
        raise
    if args.json:
        common.print_json(rec)
    else:
        for s in rec["stages"]:
            print(f"{s['name']:<16} {s['status']:<8} {s['image']}" +
                  (f"  ({s['seconds']:.1f} s)" if s.get("seconds") is not None else ""))
        if rec.get("release"):
            print(f"candidate        {', '.join(rec['release']['tags'])}  identity "
                  f"{short_digest(rec['release']['identity'])}")
        if rec.get("promotion"):
            p = rec["promotion"]
            print(f"promotion        {p['status']}" + (f": {p.get('reason')}" if p.get("reason") else "") +
                  (" (:local already held this identity)" if p["status"] == "unchanged" else ""))
        if rec.get("registry"):
            r = rec["registry"]
            print(f"registry         {r['address']}: {r['pulled']} stage(s) pulled, {r['pushed']} pushed, "
                  f"{r['refused']} refused" + (f"; dropped: {r['down']}" if r["down"] else ""))
        if rec.get("publish"):
            p = rec["publish"]
            print(f"published        {p['repository']}:{p['release']['tag']} ({p['release']['digest'][:19]}), "
                  f":local {'moved' if p['moved'] else 'unchanged'}" if p["status"] == "published" else
                  f"published        {p['status']}: {p['reason']}")
        for c in (rec.get("repro") or {}).get("stages", []):
            print(f"{c['name']:<16} {'same' if c['same'] else 'DIFFERS':<8} built twice: {c['first']}" +
                  ("" if c["same"] else f" and {c['second']}"))
            for d in c["differences"]:
                print(f"                   {d['path']}: {', '.join(d['differs'])} (layer {d['layer']})")
        print(f"run              {rec['run_id']} (imagebuild log {rec['image']} {rec['run_id']})")
    if rec.get("repro") and not rec["repro"]["same"]:
        bad = [c["name"] for c in rec["repro"]["stages"] if not c["same"]]
        log.error("error: not reproducible: stage(s) %s gave another manifest when built again (the files that "
                  "differ are listed above; docs/build.md, Reproducibility)", ", ".join(bad))
        return EXIT_FAILED
    return EXIT_OK
