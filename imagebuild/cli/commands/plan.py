"""imagebuild plan: an image's build plan (stages, build args, inputs, cache keys), printed or as JSON."""

from __future__ import annotations

from imagebuild.cli import common, options
from imagebuild.core import lazy
from imagebuild.core.errors import EXIT_OK

defn_mod = lazy.module("imagebuild.definition.reader")
engine_mod = lazy.module("imagebuild.core.engine")
plan_mod = lazy.module("imagebuild.plan.planner")
log = lazy.logger()

EXAMPLES = (
    "imagebuild plan example",
    "imagebuild plan example --no-engine --json",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("plan", help="show an image's stages, build args, inputs and cache keys",
                        description="Validate IMAGE's definition and print its build plan: the stages in "
                        "order, each with its Dockerfile, parent, build args and their values and origins, "
                        "input files with digests, and a content-addressed cache key. Has no side effects. "
                        "When a Docker engine answers, also says which stage images already exist.",
                        examples=EXAMPLES)
    options.image_argument(sp)
    options.json_flag(sp, "imagebuild.plan, version 2")
    sp.add_argument("--no-engine", action="store_true",
                    help="do not ask the Docker engine which stage images exist")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.buildstep.stagestore import StageStore

    root = common.root(args)
    # the engine is asked first and answers while the definition is read (engine.EngineQuery)
    query = None if args.no_engine else engine_mod.EngineQuery()
    dfn = defn_mod.load(root, args.image)
    pending = plan_mod.provenance.start(dfn)  # git answers while the rest is read and computed
    store = StageStore.for_image(root, dfn.name)  # built stages: read from the stage store, no engine needed
    engine_info = None
    if query is not None:
        info = query.result()
        engine_info = info.as_dict()
        if not info.reachable:
            log.info("no Docker engine reachable (%s)", info.detail)
    plan = plan_mod.make_plan(dfn, exists=lambda key: store.lookup(key) is not None, engine=engine_info,
                              prov=pending)
    if args.json:
        common.print_json(plan.as_dict())
        return EXIT_OK
    _print_plan(plan)
    return EXIT_OK


def _print_plan(plan: plan_mod.Plan) -> None:
    print(f"image     {plan.image}")
    print(f"platform  {plan.platform}")
    print(f"build id  {plan.build_id}  (from {plan.build_id_from})")
    if plan.provenance is not None:
        print(f"revision  {plan.provenance.revision or '(not in git)'}  definition {plan.provenance.definition_sha256[:23]}")
        if plan.provenance.dirty_paths:  # what makes it dirty though every file is committed
            print(f"          in a context, held by no commit: {', '.join(plan.provenance.dirty_paths)}")
    for i, s in enumerate(plan.stages, start=1):
        exists = {True: "built", False: "to build", None: "unknown"}[s.exists]
        print(f"\n{i}. {s.name}  [{exists}]")
        print(f"   image       {s.image}")
        print(f"   key         {s.key}")
        print(f"   dockerfile  {s.dockerfile}")
        print(f"   from        {s.parent} ({s.parent_kind}) = {s.parent_ref}")
        if s.uses_stages:
            print(f"   uses        {', '.join(s.uses_stages)}")
        for a in s.args:
            print(f"   arg         {a.name}={a.value}  ({a.origin})")
        for inp in s.inputs:
            print(f"   input       {inp.path} -> {inp.context_path}  sha256:{inp.sha256[:16]}  ({inp.kind})")
        for src in s.sources:
            print(f"   source      {src}")
        if s.src_mounts is not None:
            for m in s.src_mounts["mounts"]:
                dep = f", dependency of {m['dependency_of']}" if m["dependency_of"] else ""
                print(f"   mounts      {m['name']} {m['tarball']}  sha256:{m['sha256'][:16]} -> {m['dir']}{dep}")
                for o in m["overrides"]:
                    print(f"   override    {o['name']}={o['value']}  ({'environment' if o['via'] == 'env' else '-D'})")
            for x in s.src_mounts["excluded"]:
                print(f"   excluded    {x['name']} ({x['declared_by']} at {x['where']}): {x['reason']}")
            for n in s.src_mounts["missing"]:
                print(f"   mounts      {n}: NOT PREFETCHED (imagebuild prefetch {plan.image})")
        for pc in s.patch_check:
            why = " (patch changed since prefetch checked it)" if pc["stale"] else ""
            msg = f"  {pc['message'].splitlines()[0]}" if pc["message"] and pc["outcome"] != "would-apply" else ""
            print(f"   patch       {pc['outcome']:<15} {pc['patch']}{why}{msg}")
        for m in s.mounts:
            if m.stale and m.sha256:
                print(f"   STALE       {m.name}: {m.stale} (imagebuild prefetch {plan.image})")
        print(f"   epoch       SOURCE_DATE_EPOCH={s.source_date_epoch}")
        for kind, pk in sorted(s.packages.items()):
            state = "locked " + pk["locked"][:16] if pk["locked"] else "NOT PREFETCHED for these inputs"
            print(f"   {kind:<11} inputs {pk['inputs'][:16]}  {state}")
        if s.network:
            print("   network     " + common.red("NEEDS NETWORK (declared 'network: true')"))
    if plan.unpinned:
        print("\nunpinned (imagebuild prefetch resolves these):")
        for n in plan.unpinned:
            print(f"  {n.render()}")
