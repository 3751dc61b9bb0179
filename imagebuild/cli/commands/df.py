"""imagebuild df: what each image holds on disk (ops/gc.py)."""

from __future__ import annotations

from imagebuild.cli import common, options
from imagebuild.core.errors import EXIT_OK

EXAMPLES = (
    "imagebuild df",
    "imagebuild df --all",
    "imagebuild df example --json",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("df", help="show what each image holds on disk",
                        description="Per image: release images in the engine, the stage store, prefetched files "
                        "(deps-src/IMAGE) and run records, with their sizes; then BuildKit's build cache and the git "
                        "mirror cache. Reads only.",
                        examples=EXAMPLES)
    options.image_argument(sp, nargs="?", help="image name (default: every image of this project)")
    sp.add_argument("--all", action="store_true", help="also the images of other checkouts that share the stage "
                    "store (marked *)")
    options.json_flag(sp, "imagebuild.df, version 1")
    sp.set_defaults(func=run)


def run(args) -> int:
    from imagebuild.ops import gc as gc_mod

    ctx = common.ctx(args)
    doc = gc_mod.disk_usage(ctx, args.image)
    others = [r for r in doc["images"] if not r["this_project"]]
    if not args.all and not args.image:  # the shared stage store also holds other checkouts' images
        doc = {**doc, "images": [r for r in doc["images"] if r["this_project"]], "other_images": len(others)}
    if args.json:
        common.print_json(doc)
        return EXIT_OK
    h = gc_mod.human
    print(f"{'IMAGE':<24} {'ENGINE':>12} {'STAGES':>12} {'PREFETCHED':>12} {'RUNS':>10} {'TOTAL':>12}")
    for r in doc["images"]:
        mark = "" if r["this_project"] else "  (not this project's: another checkout's, in the shared stage store)"
        print(f"{r['image'] + ('*' if mark else ''):<24} {h(r['engine']['bytes']):>12} {h(r['stage_store']['bytes']):>12} "
              f"{h(r['prefetched']['bytes']):>12} {h(r['runs']['bytes']):>10} {h(r['total_bytes']):>12}")
        print(f"{'':<24} {r['engine']['releases']} release(s), {r['engine']['tags']} tag(s); "
              f"{r['stage_store']['stages']} stage(s) in {r['stage_store']['path']}; {r['runs']['count']} run(s)"
              + mark)
    if doc.get("other_images"):
        print(f"+ {doc['other_images']} image(s) of other checkouts in the shared stage store (imagebuild df --all)")
    if doc["buildkit_cache"]:
        print(f"BuildKit build cache: {h(doc['buildkit_cache']['bytes'])} (docker builder prune frees it)")
    print(f"git mirror cache: {h(doc['git_mirrors']['bytes'])} in {doc['git_mirrors']['path']}")
    for cc in doc.get("compiler_caches", []):
        print(f"compiler cache {cc['id']}: {h(cc['bytes'])} in {cc['path']}")
    return EXIT_OK
