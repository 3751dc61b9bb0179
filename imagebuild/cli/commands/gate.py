"""imagebuild gate: an image's gate checks run inside it, a receipt written; ``--check-receipt``; and
the pending gates of every definition when no IMAGE is given (gate/runner.py, gate/receipts.py)."""

from __future__ import annotations

from imagebuild.cli import common, options
from imagebuild.core import lazy
from imagebuild.core.errors import (
    EXIT_GATE_FAILED,
    EXIT_OK,
    GateFailed,
    ImagebuildError,
    UsageError,
)
from imagebuild.core.units import short_digest

defn_mod = lazy.module("imagebuild.definition.reader")
log = lazy.logger()

EXAMPLES = (
    "imagebuild gate example",
    "imagebuild gate example --check-receipt",
    "imagebuild gate some/image:tag --spec gate.yaml --junit gate.xml",
)


def add_parser(sub) -> None:
    sp = sub.add_parser("gate", help="run an image's gate checks inside it and write a receipt",
                        description="Run the gate spec's checks inside a container of the image (entrypoint "
                        "overridden, --network none, --gpus all when the host has NVIDIA GPUs) through pytest "
                        "and pytest-testinfra's docker backend; print one row per check; write a receipt keyed "
                        "by the image's store-independent identity (.imagebuild/receipts/) and the run's log. "
                        "IMAGE is a definition name: its gate spec, against IMAGE:candidate unless --ref. "
                        "REF is any image reference, with --spec FILE. Without a GPU, checks marked "
                        "`requires: gpu` are SKIPPED (never passed). Exit 4 when the gate fails (a failed "
                        "check of severity error, zero checks, a timeout), 2 for a malformed spec. "
                        "Format and check kinds: docs/gate.md.",
                        examples=EXAMPLES)
    sp.add_argument("target", metavar="IMAGE|REF", nargs="?", help="definition name, or an image reference (with "
                    "--spec); none: every definition's newest build recorded here that has no receipt of its "
                    "current gate spec yet, one line per definition")
    sp.add_argument("--ref", metavar="REF", help="with IMAGE: the image to gate (default: IMAGE:candidate)")
    sp.add_argument("--spec", metavar="FILE", help="gate spec file (required for a REF; overrides a "
                    "definition's own spec)")
    sp.add_argument("--require-gpu", action="store_true",
                    help="fail, rather than skip, checks marked `requires: gpu` when this host has no GPU")
    sp.add_argument("--junit", metavar="FILE", help="also write a JUnit XML report to FILE")
    sp.add_argument("--check-receipt", action="store_true",
                    help="run nothing: say whether the image (with IMAGE: IMAGE:local unless --ref) has a trusted "
                    "passing receipt of the definition's current gate spec, here or carried by imagebuild sync, "
                    "signed by a key of the allowed-signers file when one is configured (exit 0 passed, 4 not)")
    options.json_flag(sp, help="print the receipt as JSON (schema imagebuild.receipt, "
                      "version 2)")
    sp.set_defaults(func=run)


def run(args) -> int:
    if args.target is None:
        return _gate_pending(args)
    if args.check_receipt:
        return _check_receipt(args)
    from imagebuild.gate import runner as gate_mod  # imports pytest: only when gating

    if args.junit is not None:
        from imagebuild.core.fsutil import check_output_file

        args.junit = str(check_output_file(args.junit, "--junit"))
    ctx = common.ctx_or_none(args)  # a bare REF + --spec works outside a project too
    target = gate_mod.resolve(ctx, args.target, ref=args.ref, spec=args.spec)
    receipt = gate_mod.execute(target, require_gpu=args.require_gpu, junit=args.junit)
    if args.json:
        common.print_json(receipt.data)
    else:
        print(common.verdicts(gate_mod.render_table(receipt, target.root)))
    if not receipt.passed:
        raise gate_mod.failure(receipt)
    return EXIT_OK


def _gate_pending(args) -> int:
    """``imagebuild gate`` alone: gate what was built here and not yet gated (gate_mod.pending says
    which, and why not the others); the tables of those gated, then one line per definition. The
    exit code is the worst: 4 when a gate failed, 2 for a definition that does not load."""
    given = [f for f, v in (("--ref", args.ref), ("--spec", args.spec), ("--check-receipt", args.check_receipt),
                            ("--junit", args.junit)) if v]
    if given:
        raise UsageError(f"{given[0]} needs an IMAGE or REF", hint=f"imagebuild gate IMAGE {given[0]} ...")
    from imagebuild.gate import runner as gate_mod  # imports pytest: only when gating

    rows = []
    for p in gate_mod.pending(common.ctx(args)):
        if p.target is None:
            rows.append({"image": p.image, "status": p.status, "ref": None, "detail": p.detail,
                         "receipt": None, "exit_code": p.exit_code})
            continue
        log.info("%s: gating %s (built here, not yet gated)", p.image, p.target.ref)
        try:
            receipt = gate_mod.execute(p.target, require_gpu=args.require_gpu)
        except ImagebuildError as exc:  # the next definition is still gated; the error in full on stderr
            common.say(args, "error", exc.render())
            rows.append({"image": p.image, "status": "failed", "ref": p.target.ref,
                         "detail": exc.message.splitlines()[0], "receipt": None, "exit_code": exc.exit_code})
            continue
        s = receipt.data["summary"]
        detail = (f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped of {s['total']}"
                  + (f" ({receipt.data['reason']})" if receipt.data["reason"] else "")
                  + (f"; :local unchanged: imagebuild build {p.image} promotes it" if receipt.passed else ""))
        rows.append({"image": p.image, "status": "passed" if receipt.passed else "failed", "ref": p.target.ref,
                     "detail": detail, "receipt": str(receipt.path),
                     "exit_code": EXIT_OK if receipt.passed else EXIT_GATE_FAILED})
        if not args.json:
            print(common.verdicts(gate_mod.render_table(receipt, p.target.root)) + "\n")
    code = max((r["exit_code"] for r in rows), default=EXIT_OK)
    if args.json:
        common.print_json({"schema": "imagebuild.gate-pending", "version": 1, "exit_code": code, "images": rows})
        return code
    if not rows:
        print("no image definitions")
    for r in rows:
        what = f"{r['status']} {r['ref']}" if r["ref"] else r["status"]
        print(common.verdicts(f"{r['image']}: {what}: {r['detail']}"))
    return code


def _check_receipt(args) -> int:
    """``gate --check-receipt``: a passing receipt for the image, in this project's state folder or
    among those ``imagebuild sync`` carried to this node (receipts.synced_dir())."""
    from pathlib import Path

    from imagebuild.buildstep import promote as promote_mod
    from imagebuild.core import identity as identity_mod
    from imagebuild.definition import gatespec
    from imagebuild.gate import receipts, signing

    ctx = common.ctx_or_none(args)
    root = ctx.root if ctx is not None else None
    is_defn = root is not None and defn_mod.NAME_RE.match(args.target) and \
        (root / defn_mod.IMAGES_DIR / args.target / defn_mod.IMAGE_FILE).is_file()
    if is_defn:
        image, ref = args.target, args.ref or f"{args.target}:local"
        spec = gatespec.digest(Path(args.spec)) if args.spec else promote_mod.current_spec_digest(ctx, image)
        if spec is None:
            raise UsageError(f"image {image!r} has no gate spec: no receipt can say it passed")
    else:
        if args.ref:
            raise UsageError("--ref only goes with an IMAGE (a definition name)")
        image, ref = None, args.target
        spec = gatespec.digest(Path(args.spec)) if args.spec else None
    ident = identity_mod.inspect(ref)  # the identity of the image here: a receipt must re-hash to it
    spec_file = Path(args.spec) if args.spec else (promote_mod.current_spec(ctx, image) if is_defn else None)
    allowed = signing.allowed_signers(ctx.config if ctx is not None else None)
    verdicts = []
    if ctx is not None and spec:
        verdicts.append(receipts.check(ctx, ident.digest, spec, spec=spec_file))
    if not any(v.trusted for v in verdicts):
        hit = receipts.check_synced(ident.digest, spec, spec=spec_file, allowed=allowed)
        if hit is not None:
            verdicts.append(hit)
    good = next((v for v in verdicts if v.trusted), None)
    found, where = (good.data, good.path) if good else (None, None)
    doc = {"schema": "imagebuild.receipt-check", "version": 1, "ref": ref, "identity": ident.digest, "spec": spec,
           "passed": found is not None, "receipt": str(where) if where else None,
           "synced": bool(where and receipts.synced_dir() in Path(where).parents),
           "gpu_checks_skipped": bool(found and found.get("gpu_checks_skipped")),
           "host": (found or {}).get("host", {}).get("hostname"),
           "signed": bool(good and good.signed), "signer": good.signer if good else None,
           "allowed_signers": str(allowed) if allowed else None,
           "untrusted": [{"receipt": str(v.path), "reason": v.reason} for v in verdicts if v.untrusted]}
    if args.json:
        common.print_json(doc)
    elif found:
        print(common.verdicts(f"PASSED  {ref}  identity {short_digest(ident.digest)}"))
        print(f"        receipt {where}" + ("  (carried by imagebuild sync)" if doc["synced"] else "") +
              f"; gated on {doc['host'] or '?'}" + ("; GPU checks skipped" if doc["gpu_checks_skipped"] else ""))
        if good.signer:
            print(f"        signed by {good.signer} (verified against {allowed})")
    if found is None:
        what = f"of {image}'s current gate spec ({spec[:19]})" if image else \
            (f"of spec {spec[:19]}" if spec else "of any definition's gate spec")
        why = "".join(f"; the receipt {v.path} is not trusted: {v.reason}" for v in verdicts if v.untrusted)
        raise GateFailed(f"{ref} ({ident.digest}) has no trusted passing receipt {what}, here or carried by sync"
                         + why, hint=f"imagebuild gate {image or ref}" + ("" if image else " --spec FILE"))
    return EXIT_OK
