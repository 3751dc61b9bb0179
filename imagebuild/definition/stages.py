"""image.yaml's stages: each entry -> a ``Stage`` (parent, Dockerfile, context files and patches, git
sources, network, the packages it installs), with every problem collected.

Part of reading a definition (definition_model.py lists the parts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from imagebuild.definition import dockerfile as dockerfile_mod
from imagebuild.definition import pkgspec, textfile
from imagebuild.definition.dockerfile_rules import args_fit_command_line, check_dockerfile, compiles
from imagebuild.definition.model import (
    SHARED_PATCHES_DIR,
    STAGE_KEYS,
    STAGE_RE,
    ArgSource,
    Collector,
    InputFile,
    Parent,
    Stage,
    difflib,
    display_path,
    safe_rel_path,
    unknown_keys,
)
from imagebuild.definition.pins import parse_image_ref


@dataclass
class _Entry:
    """One entry of image.yaml's ``stages:`` being read, and where its problems go."""

    m: dict  # the entry's mapping (yamlread nodes)
    name: str
    where: str  # "stages[<name>]", the key prefix of its problems
    yfile: str
    root: Path
    d: Path  # the definition folder
    env: object  # envfile.EnvFile
    c: Collector
    line: int | None = None  # where the entry starts

    def err(self, message: str, *, line: int | None, key: str, hint: str | None = None) -> None:
        self.c.err(self.yfile, message, line=line, key=f"{self.where}.{key}" if key else self.where, hint=hint)


def parse_stage(node, yfile, root, d, env, sources, seen_names, done, images, all_names, broken, c) -> Stage | None:
    """The ``Stage`` of one image.yaml entry, or None with its problems collected. ``done``: the
    stages read so far (a stage builds only on earlier ones); ``broken``: names of earlier entries
    that had problems (nothing more is said about stages that use them); ``images`` collects the
    base images the entry names."""
    e = _entry(node, yfile, root, d, env, seen_names, c)
    if e is None:
        return None
    earlier = [s.name for s in done]
    parent, ok = _parent(e, earlier, broken, images, all_names)
    df_path, df_disp, df_bytes, parsed = _dockerfile(e)
    inputs, inputs_ok = _inputs(e)
    stage_sources, sources_ok = _sources(e, sources)
    network, network_ok = _network(e)
    reqs, apt, packages_ok = _packages(e)
    ok = ok and inputs_ok and sources_ok and network_ok and packages_ok
    args: list[ArgSource] = []
    if parsed is not None:
        ok &= check_dockerfile(e.name, parsed, df_disp, env, earlier + sorted(broken), inputs, args, c,
                               check_copies=inputs_ok)
        ok &= args_fit_command_line(e.name, parsed, df_disp, env, args, c)
    if not ok or parsed is None or parent is None:
        return None
    desc = e.m["description"].value if "description" in e.m else None
    return Stage(name=e.name, dockerfile=df_path, dockerfile_display=df_disp, dockerfile_bytes=df_bytes,
                 parsed=parsed, parent=parent, inputs=tuple(inputs), sources=tuple(stage_sources),
                 network=network, description=desc, args=tuple(args), requirements=reqs, apt=apt)


def _entry(node, yfile, root, d, env, seen_names, c) -> _Entry | None:
    """The entry's mapping and valid, unique name (None when either is missing)."""
    if not isinstance(node.value, dict):
        c.err(yfile, "each stage must be a mapping with at least 'name' and 'from'", line=node.line)
        return None
    unknown_keys(node, STAGE_KEYS, yfile, "a stage", c)
    m = node.value
    if "name" not in m:
        c.err(yfile, "stage without a name", line=node.line, key="name")
        return None
    name = m["name"].value
    where = f"stages[{name}]"
    if not isinstance(name, str) or not STAGE_RE.match(name):
        c.err(yfile, f"invalid stage name {name!r}: expected lower-case letters, digits, '-' or '_', "
              "starting with a letter", line=m["name"].line, key="name")
        return None
    if name in seen_names:
        c.err(yfile, f"duplicate stage name {name!r} (first on line {seen_names[name]})", line=m["name"].line,
              key=f"{where}.name")
        return None
    seen_names[name] = m["name"].line
    return _Entry(m, name, where, yfile, root, d, env, c, node.line)


def _parent(e: _Entry, earlier: list[str], broken: set, images: dict, all_names: list[str]):
    """(``Parent``, ok): ``from:`` names an earlier stage or a versions.env key holding an image."""
    env = e.env
    if "from" not in e.m:
        e.err(f"stage {e.name!r} has no 'from'", line=e.line, key="from",
              hint="'from' names an earlier stage or a versions.env key holding a base image")
        return None, False
    fv, fl = e.m["from"].value, e.m["from"].line
    if isinstance(fv, str) and fv in earlier:
        return Parent("stage", fv), True
    if isinstance(fv, str) and (fv in broken or fv in env.broken):
        return None, False  # already reported
    if isinstance(fv, str) and env.get(fv) is not None:
        ref, msg = parse_image_ref(fv, env.get(fv))
        if msg:
            e.c.err(env.display, msg, line=env.line_of(fv), key=fv)
            return None, False
        images[fv] = ref
        if not ref.pinned:
            e.c.note(env.display, f"base image {ref.value!r} has no digest: unpinned "
                     "(imagebuild prefetch resolves and pins it)", line=env.line_of(fv), key=fv)
        return Parent("image", fv), True
    later = isinstance(fv, str) and fv in all_names
    close = difflib.get_close_matches(str(fv), earlier + list(env.entries), n=1)
    e.err(f"stage {e.name!r}: from {fv!r} is " +
          ("a later stage (stages build in the order listed)" if later else
           "neither an earlier stage nor a versions.env key"), line=fl, key="from",
          hint=f"did you mean {close[0]!r}?" if close else f"earlier stages: {', '.join(earlier) or 'none'}")
    return None, False


def _dockerfile(e: _Entry):
    """(path, shown path, bytes, parsed Dockerfile or None): ``dockerfile:``, default ``Dockerfile.<name>``."""
    m = e.m
    df_decl = m["dockerfile"].value if "dockerfile" in m else f"Dockerfile.{e.name}"
    df_line = m["dockerfile"].line if "dockerfile" in m else m["name"].line
    df_path = safe_rel_path(df_decl, e.d, e.yfile, df_line, f"{e.where}.dockerfile", e.c)
    if df_path is None:
        return None, str(df_decl), b"", None
    df_disp = display_path(e.root, df_path)
    kind = textfile.unreadable_kind(df_path)
    if kind:  # never read: a FIFO would hang validate
        e.err(f"stage {e.name!r}: {df_disp} is {kind}, not a Dockerfile", line=df_line, key="dockerfile")
        return df_path, df_disp, b"", None
    try:
        if df_path.is_file() and df_path.stat().st_size > textfile.MAX_BYTES:
            e.c.err(df_disp, f"is {df_path.stat().st_size} bytes: larger than {textfile.MAX_BYTES} bytes (8 MiB), "
                    "the limit for a definition file")
            return df_path, df_disp, b"", None
        df_bytes = df_path.read_bytes()
        return df_path, df_disp, df_bytes, dockerfile_mod.parse(textfile.decode(df_bytes))
    except textfile.TextError as exc:
        e.c.err(df_disp, exc.message, line=exc.line)
    except FileNotFoundError:
        e.err(f"stage {e.name!r}: Dockerfile {df_decl!r} not found", line=df_line, key="dockerfile",
              hint=f"create {df_disp} or set 'dockerfile:' for the stage")
    except IsADirectoryError:
        e.err(f"stage {e.name!r}: {df_disp} is a folder, not a Dockerfile", line=df_line, key="dockerfile")
    except OSError as exc:
        e.c.err(df_disp, f"cannot read: {exc.strerror}", hint="check the file's permissions")
    return df_path, df_disp, b"", None


def _inputs(e: _Entry) -> tuple[list[InputFile], bool]:
    """``files:`` and ``patches:``: what the stage's build context holds."""
    inputs: list[InputFile] = []
    ok = True
    for key, kind in (("files", "file"), ("patches", "patch")):
        if key not in e.m:
            continue
        items = e.m[key].value
        if not isinstance(items, list):
            e.err("expected a list of paths", line=e.m[key].line, key=key)
            ok = False
            continue
        for item in items:
            inp = _input(item, kind, e.root, e.d, e.yfile, f"{e.where}.{key}", e.c)
            if inp is None:
                ok = False
            elif any(i.context_path == inp.context_path for i in inputs):
                e.err(f"{inp.context_path!r} is declared twice", line=item.line, key=key)
                ok = False
            else:
                inputs.append(inp)
    return inputs, ok


def _sources(e: _Entry, sources: dict) -> tuple[list[str], bool]:
    """``sources:``: the git sources mounted into the stage (their FetchContent deps follow them)."""
    if "sources" not in e.m:
        return [], True
    items = e.m["sources"].value
    if not isinstance(items, list):
        e.err("expected a list of git source names", line=e.m["sources"].line, key="sources")
        return [], False
    out, ok = [], True
    for item in items:
        sname = item.value
        if sname in sources:
            out.append(sname)
        elif isinstance(sname, str) and e.env.get(f"{sname}_REPO") is not None:
            ok = False  # already reported against versions.env
        else:
            close = difflib.get_close_matches(str(sname), list(sources), n=1)
            e.err(f"unknown git source {sname!r}: versions.env has no {sname}_REPO", line=item.line, key="sources",
                  hint=f"did you mean {close[0]!r}?" if close else
                  f"known sources: {', '.join(sorted(sources)) or 'none'}")
            ok = False
    return out, ok


def _network(e: _Entry) -> tuple[bool, bool]:
    if "network" not in e.m:
        return False, True
    network = e.m["network"].value
    if not isinstance(network, bool):
        e.err("expected true or false", line=e.m["network"].line, key="network")
        return False, False
    return network, True


def _packages(e: _Entry):
    """(requirements, apt list, ok): the wheels and debs the stage installs (pkgspec.py)."""
    reqs = apt = None
    ok = True
    pkg_path = lambda v, line, key: safe_rel_path(v, e.d, e.yfile, line, key, e.c)  # noqa: E731
    disp = lambda p: display_path(e.root, p)  # noqa: E731
    if "requirements" in e.m:
        reqs = pkgspec.stage_requirements(e.m["requirements"], e.yfile, e.where, pkg_path, disp, e.env, e.c.err)
        ok &= reqs is not None
    if "apt" in e.m:
        apt = pkgspec.stage_apt(e.m["apt"], e.yfile, e.where, pkg_path, disp, e.c.err, e.c.note)
        ok &= apt is not None
    return reqs, apt, ok


def _folder_trouble(folder: Path, shown: str) -> str | None:
    """What in the declared folder ``folder`` (``shown``: as declared) a build context cannot hold, said
    with its escaped path: a FIFO, a socket or a device (a read would hang), a name that is not UTF-8."""
    import stat

    from imagebuild.core.errors import excerpt

    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for n in sorted(dirnames + filenames):
            full = Path(dirpath) / n
            rel = f"{shown}/{full.relative_to(folder).as_posix()}"
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                return f"{excerpt(rel, 80)} has a name that is not UTF-8"
            try:
                mode = os.lstat(full).st_mode
            except OSError:
                continue
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "a device" if stat.S_ISBLK(mode) or stat.S_ISCHR(mode) else None)
            if kind:
                return f"{excerpt(rel, 80)} is {kind}: a build context holds files, folders and symbolic links only"
    return None


def _input(item, kind, root: Path, d: Path, yfile: str, key: str, c: Collector) -> InputFile | None:
    value = item.value
    if isinstance(value, str) and value.startswith(SHARED_PATCHES_DIR + "/"):
        base = root / SHARED_PATCHES_DIR
        rel = value[len(SHARED_PATCHES_DIR) + 1:]
    else:
        base, rel = d, value
    full = safe_rel_path(rel, base, yfile, item.line, key, c)
    if full is None:
        return None
    if not full.exists():
        c.err(yfile, f"{value!r} not found ({display_path(root, full)})", line=item.line, key=key)
        return None
    kind_of = textfile.unreadable_kind(full)
    if kind_of:  # plan and build would refuse it (context_stream.py); validate says so too
        c.err(yfile, f"{value!r} is {kind_of}: a build context holds files, folders and symbolic links only",
              line=item.line, key=key, hint="remove it from the declared files")
        return None
    trouble = _folder_trouble(full, str(value).rstrip("/")) if full.is_dir() else None
    if trouble:  # plan and build would refuse it (context_stream.py); validate says so too
        c.err(yfile, trouble, line=item.line, key=key,
              hint="a build context holds files, folders and symbolic links with UTF-8 names only")
        return None
    if not os.access(full, os.R_OK) or (full.is_dir() and not os.access(full, os.X_OK)):
        c.err(yfile, f"{value!r} is not readable", line=item.line, key=key, hint="check its permissions")
        return None
    if full.is_file():
        try:
            with open(full, "rb"):
                pass
        except OSError as exc:
            c.err(yfile, f"{value!r}: cannot read: {exc.strerror}", line=item.line, key=key)
            return None
    if kind == "patch":
        if not (full.is_file() and full.name.startswith("patch_") and full.name.endswith(".py")):
            c.err(yfile, f"patch {value!r} must be a file named patch_*.py", line=item.line, key=key)
            return None
        if not compiles(full, display_path(root, full), c):
            return None
        ctx = f"patches/{full.name}"
    else:
        ctx = PurePosixPath(rel).as_posix().rstrip("/")
    return InputFile(declared=str(value), path=full, context_path=ctx, kind=kind)
