"""``imagebuild shell IMAGE STAGE``: a shell where STAGE's RUN steps run, to see why one failed.

A container of the stage's parent (the earlier stage's image from the stage store, loaded into the
engine under a temporary tag, or the pinned base image), with ``--network none`` as every stage
builds (``network: true`` stages excepted), the stage's build args (``versions.env``'s, a default's)
in its environment as a RUN sees them, and the stage's inputs mounted read-only where the build
mounts them by convention:

    /imagebuild/context   the stage's build context (what its COPY lines read), as the build sends it
    /imagebuild/src       imagebuild-src: the verified source tarballs and imagebuild-src.sh
    /imagebuild/wheels    imagebuild-wheels: the prefetched wheels (empty when none)
    /imagebuild/apt       imagebuild-apt: the prefetched debs (empty when none)

Every input is checked against the lock first, as a build checks it. The container, its temporary
folder and the temporary tag are removed when the shell exits; nothing of the project changes.
docs/build.md, "A shell in a stage".
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

from imagebuild.buildstep import builder
from imagebuild.core import context as context_mod
from imagebuild.core import run as run_mod
from imagebuild.core.errors import OperationFailed, UsageError
from imagebuild.definition import reader as defn_mod
from imagebuild.fetch import packages
from imagebuild.plan import planner as plan_mod
from imagebuild.plan import source_mounts

log = logging.getLogger("imagebuild")

CONTEXT_MOUNT = "/imagebuild/context"
SHELL_LABEL = "io.imagebuild.shell"
LOADER = "FROM imagebuild-parent\n"  # the parent stage, from the stage store, into the engine


def mounts(named: dict[str, str], context: Path) -> list[tuple[str, str]]:
    """(host folder, container path) of each input, as the build mounts them."""
    return [(str(context), CONTEXT_MOUNT), (named[builder.NAMED_SRC], source_mounts.MOUNT),
            (named[builder.NAMED_WHEELS], packages.WHEELS_MOUNT), (named[builder.NAMED_APT], packages.APT_MOUNT)]


def shell(ctx: context_mod.Context | Path, image: str, stage: str, command: list[str] | None = None) -> int:
    """Start the stage's shell (or run ``command`` in it); returns its exit code."""
    ctx = context_mod.of(ctx)
    defn_mod.check_image_name(image)
    b = builder.prepare(ctx, image, builder.Options(progress="quiet"))
    names = [s.name for s in b.plan.stages]
    if stage not in names:
        close = defn_mod.difflib.get_close_matches(stage, names, n=1)
        raise UsageError(f"{image} has no stage {stage!r}",
                         hint=(f"did you mean {close[0]!r}? " if close else "") + f"stages: {', '.join(names)}")
    st = b.plan.stage(stage)
    inputs = builder.inputs_of(b, st)  # checked against the lock, as a build checks them
    top = builder.tmp_root(ctx)
    top.mkdir(parents=True, exist_ok=True)
    tag = None
    with tempfile.TemporaryDirectory(prefix=f"shell-{image}-", dir=top) as tmp_s:
        tmp = Path(tmp_s)
        empty = tmp / "empty"
        empty.mkdir()
        context, named = builder.stage_inputs(b, st, inputs, tmp, empty)
        try:
            if st.parent_kind == "stage":
                tag = _load_parent(b, st, tmp)
                parent = tag
            else:
                parent = st.parent_ref
            argv = _run_argv(b, st, parent, mounts(named, context), command)
            log.info("shell: stage %s of %s, FROM %s (%s), network %s; the stage's inputs: %s; its build "
                     "args in the environment; exit leaves nothing behind", stage, image,
                     st.parent if st.parent_kind == "stage" else parent,
                     "its parent stage" if st.parent_kind == "stage" else "its base image",
                     "default" if st.network else "none",
                     ", ".join(where for _, where in mounts(named, context)))
            return run_mod.run(argv, check=False, capture=False).returncode
        finally:
            if tag is not None:
                run_mod.run(["docker", "image", "rm", "--force", tag], check=False, timeout=120)


def _load_parent(b: builder.Build, st: plan_mod.PlannedStage, tmp: Path) -> str:
    """The parent stage's image from the stage store, into the engine under a temporary tag."""
    ref = b.store.lookup(b.plan.stage(st.parent).key)
    if ref is None:
        raise OperationFailed(f"stage {st.name!r}'s parent, stage {st.parent!r}, is not built (no "
                              f"{b.plan.stage(st.parent).image} in the stage store)",
                              hint=f"imagebuild build {b.defn.name} --until {st.parent}")
    df = tmp / "Dockerfile.shell"
    df.write_text(LOADER)
    ctx = tmp / "loader"
    ctx.mkdir()
    tag = f"imagebuild/{b.defn.name}:shell-{st.name}-{b.run_id.rsplit('-', 1)[-1]}"
    argv = builder.buildx_argv(context=ctx, dockerfile=df, build_args={},
                               contexts={plan_mod.PARENT_CONTEXT: b.store.context(ref.manifest)}, labels={},
                               network="none", platform=b.plan.platform, no_cache=False, output=None, tag=tag,
                               metadata=None, name=f"{b.defn.name}/shell-{st.name}")
    argv = [a.replace("--progress=rawjson", "--progress=quiet") for a in argv]
    log.info("shell: loading stage %s (the parent of %s) into the engine as %s", st.parent, st.name, tag)
    run_mod.run(argv, timeout=1800, hint="is the engine's BuildKit healthy? (imagebuild doctor)")
    return tag


def _run_argv(b: builder.Build, st: plan_mod.PlannedStage, parent: str, mnt: list[tuple[str, str]],
              command: list[str] | None) -> list[str]:
    argv = ["docker", "run", "--rm", "-i", "--platform", b.plan.platform, "--label",
            f"{SHELL_LABEL}={b.defn.name}/{st.name}", "--entrypoint", "", "--workdir", CONTEXT_MOUNT]
    if sys.stdin.isatty() and sys.stdout.isatty():
        argv.append("-t")
    if not st.network:
        argv += ["--network", "none"]
    for host, where in mnt:
        argv += ["--mount", f"type=bind,source={host},target={where},readonly"]
    for k, v in {**st.build_args(), "SOURCE_DATE_EPOCH": str(st.source_date_epoch)}.items():
        if k != defn_mod.ARG_PARENT:
            argv += ["--env", f"{k}={v}"]
    argv.append(parent)
    return argv + (list(command) if command else ["sh", "-c", "command -v bash >/dev/null && exec bash || exec sh"])
