"""Read and validate an image definition: ``docker-images/<name>/`` -> a frozen ``Definition``.

A definition folder holds:

- ``versions.env``: every pin (git sources, base images, versions fed to build args);
- ``image.yaml``: target platform, the stages in build order (Dockerfile, parent, context
  files, patches, sources), and where the gate spec lives;
- one Dockerfile per stage, and the files and patches the stages consume.

Every problem found is collected and raised at once as ``DefinitionError`` (exit 2), each naming
its file, line or key, what was expected, and a hint. Nothing here writes anything.
The format is documented in docs/image-definition.md.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from imagebuild.core import yamlread
from imagebuild.core.errors import DefinitionError, Problem
from imagebuild.core.fsutil import inside, is_loop, special_kind
from imagebuild.definition import envfile, pkgspec
from imagebuild.definition import source_options as source_options_mod
from imagebuild.definition.model import *  # noqa: F403  (the records, names and rules: imported from here)
from imagebuild.definition.model import (
    DEFAULT_GATE_FILE,
    IMAGE_FILE,
    IMAGES_DIR,
    PLATFORM_RE,
    TOP_KEYS,
    VERSIONS_FILE,
    Collector,
    Definition,
    ImageRef,
    Stage,
    check_image_name,
    difflib,
    display_path,
    list_images,
    read_text,
    safe_rel_path,
    unknown_keys,
)
from imagebuild.definition.pins import git_sources, parse_image_ref  # noqa: F401  (parse_image_ref: re-exported)
from imagebuild.definition.source_options import (  # noqa: F401  (re-exported: prefetch and tests import them from here)
    ENV_NAME_RE,
    SOURCE_KEYS,
    SourceOptions,
    default_source_options,
)
from imagebuild.definition.stages import parse_stage

NO_DEFINITION = "no such image definition (folder not found)"


def unknown_image(root: Path | None, name: str, *, why: str = NO_DEFINITION, note: str | None = None) -> DefinitionError:
    """The one error every command gives for a wrong image name (exit 2): ``docker-images/NAME:
    IMAGE: <why>``, with a did-you-mean among this project's images (else the known ones) and, after
    before it, the command's own ``note`` (where else the name could be meant)."""
    base = Path(root) if root is not None else Path.cwd()
    known = list_images(base) if (base / IMAGES_DIR).is_dir() else []
    close = close_image(base, name)
    hint = f"did you mean {close!r}?" if close else f"known images: {', '.join(known) or 'none'} (imagebuild list)"
    return DefinitionError([Problem(display_path(base, base / IMAGES_DIR / name), why, key="IMAGE",
                                    hint=(f"{note}; " if note else "") + hint)], image=name)


def close_image(root: Path | None, name: str) -> str | None:
    """The image of this project whose name is closest to ``name`` (a typo), or None."""
    if root is None or not (Path(root) / IMAGES_DIR).is_dir():
        return None
    close = difflib.get_close_matches(name, list_images(Path(root)), n=1)
    return close[0] if close else None


def require_image(root: Path | None, name: str, *, note: str | None = None) -> None:
    """``name`` is a valid image name with a definition folder under ``root``; else ``unknown_image``."""
    check_image_name(name)
    if root is None or not (Path(root) / IMAGES_DIR / name).is_dir():
        raise unknown_image(root, name, note=note)


def load(root: Path, name: str, *, versions: Path | None = None, versions_display: str | None = None) -> Definition:
    """Read, validate and return the definition ``name``; raise DefinitionError on any problem.

    ``versions``: read that file as the definition's versions.env (shown as ``versions_display``):
    unbundle validates the definition with a bundle's pins before it installs them."""
    check_image_name(name)
    root = root.resolve()
    d = root / IMAGES_DIR / name
    c = Collector()
    disp = lambda p: display_path(root, p)  # noqa: E731
    if not d.is_dir():
        raise unknown_image(root, name)

    if versions is None:
        env = _load_env(d / VERSIONS_FILE, disp(d / VERSIONS_FILE), c)
    else:
        env = _load_env(Path(versions), versions_display or str(versions), c)
    spec = _load_yaml(d / IMAGE_FILE, disp(d / IMAGE_FILE), c)
    if env is None or spec is None:
        raise DefinitionError(c.problems, image=name)

    yfile = disp(d / IMAGE_FILE)
    _reserved_names(env, c)
    sources = git_sources(env, c)
    platform, description, gate, stage_nodes = _top_level(spec, yfile, d, c)
    python, apt_snapshot, _ = pkgspec.top_level(spec.value, yfile, env, c.err)
    source_options = source_options_mod.source_options(spec, yfile, env, sources, c.err)
    build_metadata = _build_metadata(spec.value.get("build_metadata"), yfile, c)
    verified_bases = _verified_bases(spec.value.get("verified_bases"), yfile, env, c)

    stages: list[Stage] = []
    images: dict[str, ImageRef] = {}
    seen_names: dict[str, int] = {}
    broken: set = set()  # stages with problems: later stages that use them report nothing more
    all_names = [n.value["name"].value for n in stage_nodes
                 if isinstance(n.value, dict) and "name" in n.value]
    for node in stage_nodes:
        st = parse_stage(node, yfile, root, d, env, sources, seen_names, stages, images, all_names, broken, c)
        if st is not None:
            stages.append(st)
        elif isinstance(node.value, dict) and "name" in node.value:
            broken.add(node.value["name"].value)

    if python is None and "python" not in spec.value:
        for st in stages:
            if st.requirements is not None:
                c.err(yfile, f"stage {st.name!r} installs wheels but image.yaml has no 'python:'",
                      key=f"stages[{st.name}].requirements", line=1,
                      hint='add e.g. python: "3.12" (the base image\'s CPython) at the top level')
                break
    if c.problems:  # (a reserved name a Dockerfile also declares is found twice: said once)
        once = {(q.file, q.line, q.key, q.message): q for q in reversed(c.problems)}  # the first one's hint
        raise DefinitionError(sorted(once.values(), key=c.problems.index), image=name)
    return Definition(
        name=name, root=root, dir=d, platform=platform, description=description, env=env,
        stages=tuple(stages), sources=sources, images=images, gate=gate, notices=tuple(c.notices),
        source_options=source_options, python=python, apt_snapshot=apt_snapshot, build_metadata=build_metadata,
        verified_bases=verified_bases)


def _verified_bases(node, yfile: str, env, c: Collector) -> tuple[str, ...]:
    """``verified_bases: [KEY, ...]``: base images (versions.env keys) the lane was verified on.
    Prefetch pins such a base only from the image the engine holds, never from a registry tag."""
    if node is None:
        return ()
    v = node.value
    if not isinstance(v, list) or not all(isinstance(x.value, str) for x in v):
        c.err(yfile, f"expected a list of versions.env keys, got {node.plain()!r}", line=node.line,
              key="verified_bases", hint="e.g. verified_bases: [DSV4_BASE]")
        return ()
    out = []
    for x in v:
        if env.get(x.value) is None:
            c.err(yfile, f"{x.value!r} is not a versions.env key", line=x.line or node.line, key="verified_bases",
                  hint="name the key that holds the base image, e.g. DSV4_BASE")
        else:
            out.append(x.value)
    return tuple(out)


def _reserved_names(env: envfile.EnvFile, c: Collector) -> None:
    """Names the plan, BuildKit or imagebuild itself provide cannot be pins, used by a Dockerfile or
    not: ``PARENT``, ``STAGE_<stage>``, ``IMAGEBUILD_*``, BuildKit's platform args."""
    from imagebuild.definition.model import ARG_PARENT, BUILDKIT_ARGS, STAGE_ARG_PREFIX

    for key in env.entries:
        if key == ARG_PARENT or key.startswith((STAGE_ARG_PREFIX, "IMAGEBUILD_")) or key in BUILDKIT_ARGS:
            c.err(env.display, f"{key} is provided by imagebuild and cannot be set in versions.env",
                  line=env.line_of(key), key=key,
                  hint="PARENT, STAGE_<stage>, IMAGEBUILD_* and BuildKit's TARGET*/BUILD* args are reserved: "
                  "rename the pin")


def _build_metadata(node, yfile: str, c: Collector) -> str | None:
    """``build_metadata: /workspace/build-metadata.yaml``: an absolute file path in the image, outside
    /opt/imagebuild (which the release owns)."""
    if node is None:
        return None
    v = node.value
    ok = isinstance(v, str) and v.startswith("/") and not v.endswith("/") and "\n" not in v
    parts = PurePosixPath(v).parts if ok else ()
    if not ok or ".." in parts or len(parts) < 2 or parts[1:3] == ("opt", "imagebuild"):
        c.err(yfile, f"expected an absolute file path in the image outside /opt/imagebuild, got {node.plain()!r}",
              line=node.line, key="build_metadata", hint="e.g. /workspace/build-metadata.yaml (eugr's audit file)")
        return None
    return str(PurePosixPath(v))


def _inside(path: Path, display: str, c: Collector) -> bool:
    """Whether ``path`` stays inside its definition folder (a symlink may point within it, never
    out of it: its target is then not read, and nothing of it is quoted)."""
    if is_loop(path):
        c.err(display, "is a symlink loop (its links never reach a file): not read",
              hint="point it at a file in the definition folder, or make it a file")
        return False
    if not inside(path, path.parent):
        c.err(display, "is a symlink that leads outside its definition folder: not read",
              hint="definition files live in the definition folder (a symlink to another file in it is fine)")
        return False
    return True


def _load_env(path: Path, display: str, c: Collector) -> envfile.EnvFile | None:
    if path.is_symlink() and not _inside(path, display, c):
        return None
    if not path.is_file():
        if path.exists():  # a FIFO would hang the read; a folder is no file
            return read_text(path, display, c) and None
        c.err(display, "missing", hint="every image folder holds a versions.env with its pins")
        return None
    text = read_text(path, display, c)
    if text is None:
        return None
    # problems are collected into c.problems; keep going so every file is checked in one run
    return envfile.parse_text(text, path, display, c.problems)




def _load_yaml(path: Path, display: str, c: Collector) -> yamlread.Node | None:
    if path.is_symlink() and not _inside(path, display, c):
        return None
    if not path.is_file() and path.exists():  # a FIFO would hang the read; a folder is no file
        return read_text(path, display, c) and None
    if not path.is_file():
        c.err(display, "missing", hint="every image folder holds an image.yaml listing its stages "
              "(see docs/image-definition.md)")
        return None
    text = read_text(path, display, c)
    if text is None:
        return None
    try:
        node = yamlread.load(text)
    except yamlread.YamlError as exc:
        c.err(display, str(exc), line=exc.line)
        return None
    if node is None or not isinstance(node.value, dict):
        c.err(display, "expected a mapping with 'platform' and 'stages'", line=node.line if node else 1)
        return None
    return node


def _top_level(spec: yamlread.Node, yfile: str, d: Path, c: Collector):
    unknown_keys(spec, TOP_KEYS, yfile, "image.yaml", c)
    m = spec.value
    platform = ""
    if "platform" not in m:
        c.err(yfile, "missing required key", key="platform", line=1,
              hint="the target platform, e.g. 'platform: linux/arm64' for DGX Spark")
    else:
        platform = m["platform"].value
        if not isinstance(platform, str) or not PLATFORM_RE.match(platform):
            c.err(yfile, f"invalid platform {platform!r}: expected linux/<arch>, e.g. linux/arm64",
                  line=m["platform"].line, key="platform")
            platform = ""
    description = m["description"].value if "description" in m else None
    if description is not None and not isinstance(description, str):
        c.err(yfile, "expected a string", line=m["description"].line, key="description")
        description = None

    gate = None
    if "gate" in m:
        g = m["gate"].value
        gp = safe_rel_path(g, d, yfile, m["gate"].line, "gate", c)
        if gp is not None:
            if not gp.is_file():
                kind = special_kind(gp.stat().st_mode) if gp.exists() else None
                c.err(yfile, f"gate spec {g!r} is {kind}, expected a gate spec file" if kind else
                      f"gate spec {g!r} not found", line=m["gate"].line, key="gate")
            else:
                gate = gp
    elif (d / DEFAULT_GATE_FILE).is_file():
        gate = d / DEFAULT_GATE_FILE
    if gate is not None:  # the gate spec is part of the definition: validate it too (docs/gate.md)
        from imagebuild.definition import gatespec

        try:
            shown = (PurePosixPath(yfile).parent / gate.relative_to(d).as_posix()).as_posix()
        except ValueError:
            shown = str(gate)
        try:
            gatespec.load(gate, display=shown)
        except DefinitionError as exc:
            c.problems.extend(exc.problems)

    stage_nodes: list[yamlread.Node] = []
    if "stages" not in m:
        c.err(yfile, "missing required key", key="stages", line=1,
              hint="list the stages in build order, each with name and from")
    elif not isinstance(m["stages"].value, list) or not m["stages"].value:
        c.err(yfile, "expected a non-empty list of stages", line=m["stages"].line, key="stages")
    else:
        stage_nodes = m["stages"].value
    return platform, description, gate, stage_nodes
