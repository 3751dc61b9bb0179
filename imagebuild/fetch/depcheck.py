"""Prefetch's FetchContent check: what a composed tree declares against what the image pins.

Given the scan of each source whose tree is read (fetchcontent.py) and the image's git sources
with their ``sources:`` options, decide, without touching the network or the disk:

- every declaration is pinned by a source (``dependency_of`` + ``declares``) or excluded by the
  declaring source (``exclude: {name: reason}``); anything else is an error naming the file and
  line, the branch it sits under, and the exact versions.env lines and ``sources:`` entry to add
  (only the ones that are not there yet);
- each dependency's override variable (``env:``, or the one the tree's ``SOURCE_DIR`` branch
  reads, or FetchContent's own ``FETCHCONTENT_SOURCE_DIR_<NAME>``) is one the tree reads, and
  whether it reads it from the environment or as a CMake variable (``-D``); an unread name is
  an error with the names that are read;
- the tag a declaration gives through a variable is resolved (``set()`` in the tree) and
  compared with the pin by the caller; a value that cannot be resolved is said so;
- which submodules to pack: what the declaration's ``GIT_SUBMODULES`` asks for, unless the
  image says otherwise, with a warning when the two disagree;
- a second declaration of the same name with other values is reported.

docs/prefetch.md ("FetchContent check") documents the rules.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from imagebuild.core.errors import Problem
from imagebuild.definition.source_options import ENV_NAME_RE, SourceOptions
from imagebuild.fetch.fetchcontent import Declaration, Scan, fetchcontent_dir_var

_MAX_READ_AT = 3


@dataclass
class Submodules:
    """Which submodules of a source to pack."""

    paths: list[str] | None  # top-level submodule paths; None: all of them
    recurse: bool  # their own submodules too (CMake's GIT_SUBMODULES_RECURSE, on by default)
    origin: str  # where the choice comes from, for messages and the lock

    def as_dict(self) -> dict:
        return {"paths": self.paths, "recurse": self.recurse, "origin": self.origin}


@dataclass
class DepInfo:
    """What the check decided for one dependency source."""

    decl: Declaration | None
    override: dict | None
    submodules: Submodules


@dataclass
class Result:
    problems: list[Problem] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    deps: dict[str, DepInfo] = field(default_factory=dict)  # dependency source name -> decision
    excluded: dict[str, list[dict]] = field(default_factory=dict)  # scanned source -> its exclusions


def _when(d: Declaration) -> str:
    """The branches a declaration sits under, short: 'if (X) (CMakeLists.txt:135) > ...'."""
    parts = []
    for w in d.when:
        where, _, what = w.partition(": ")
        parts.append(f"{what} ({where})" if what else where)
    return " > ".join(parts)


def override_for(scan: Scan, decl: Declaration | None, explicit: str | None, dep_name: str,
                 declares: str) -> tuple[dict | None, str | None, list[str]]:
    """(override record, error message, names the tree reads that could be meant).

    The variable is ``explicit`` (image.yaml ``env:``), else the one the tree's SOURCE_DIR-only
    declaration of the same name reads, else FetchContent's own ``FETCHCONTENT_SOURCE_DIR_<NAME>``.
    It must be read by the tree: from the environment (``$ENV{X}``, ``DEFINED ENV{X}``) and/or as a
    CMake variable (``${X}``, ``if(X)``, ``if(DEFINED X)``; FetchContent itself reads its own
    variable for every declared name). It is delivered from the environment when the tree reads
    it there and it is a valid environment name, else as ``-D``.
    """
    name_in_tree = decl.name if decl is not None else declares
    # FetchContent reads its own variable for declared content, not for FetchContent_Populate's direct form
    own = fetchcontent_dir_var(name_in_tree) if decl is None or decl.kind == "declare" else None
    guards = guard_names(decl)
    if explicit:
        name, origin = explicit, "image.yaml"
    elif decl is not None and decl.override:
        name, origin = decl.override, f"the tree's SOURCE_DIR branch at {decl.override_where}"
    elif own is not None:
        name, origin = own, "FetchContent's own variable"
    elif guards:
        name, origin = guards[0], "the condition the declaration is the else branch of"
    else:
        return None, f"no override is known for {dep_name} ({name_in_tree!r} is populated directly)", \
            suggestions(scan, decl, "", name_in_tree)
    env_at, var_at = scan.how_read(name)
    var_at = list(var_at)
    if name == own:
        var_at.insert(0, f"FetchContent (FETCHCONTENT_SOURCE_DIR_<NAME> of {name_in_tree!r})")
    if not env_at and not var_at:
        return None, (f"override {name!r} of {dep_name} is not read by the tree's CMake files"), \
            suggestions(scan, decl, name, name_in_tree)
    via = "env" if env_at and ENV_NAME_RE.match(name) else "cmake"
    return {"name": name, "via": via, "from": origin, "env_read_at": env_at[:_MAX_READ_AT],
            "cmake_read_at": var_at[:_MAX_READ_AT]}, None, []


def suggestions(scan: Scan, decl: Declaration | None, wrong: str, name_in_tree: str) -> list[str]:
    """Names the tree reads that ``wrong`` may have meant: the declaration's own override first,
    then FetchContent's variable, then close spellings."""
    out: list[str] = []
    if decl is not None and decl.override:
        out.append(decl.override)
    out += guard_names(decl)
    if decl is None or decl.kind == "declare":
        out.append(fetchcontent_dir_var(name_in_tree))
    if wrong:
        out += difflib.get_close_matches(wrong, scan.read_names(), n=3, cutoff=0.75)
    return list(dict.fromkeys(n for n in out if n != wrong))


def guard_names(decl: Declaration | None) -> list[str]:
    """Names read in the conditions a declaration is the ``else`` branch of: ``if(DEFINED
    ENV{ACL_ROOT_DIR}) ... else() FetchContent_Populate(arm_compute ...)`` makes ACL_ROOT_DIR the
    way to skip the download."""
    out: list[str] = []
    for w in (decl.when if decl is not None else ()):
        _, _, what = w.partition(": ")
        if not what.startswith("else of if"):
            continue
        for m in re.finditer(r"ENV\{([A-Za-z_][A-Za-z0-9_]*)\}|\b([A-Za-z_][A-Za-z0-9_]*)\b", what[len("else of if"):]):
            n = m.group(1) or m.group(2)
            if n and n.upper() not in _NOT_NAMES and not n.startswith(("CMAKE_", "FETCHCONTENT_BASE")):
                out.append(n)
    return list(dict.fromkeys(out))


_NOT_NAMES = frozenset({"NOT", "AND", "OR", "DEFINED", "ENV", "STREQUAL", "MATCHES", "EQUAL", "IS_DIRECTORY",
                        "EXISTS", "IS_ABSOLUTE", "TRUE", "FALSE", "ON", "OFF", "VERSION_LESS", "VERSION_GREATER",
                        "LESS", "GREATER"})


def describe_read(scan: Scan, name: str, name_in_tree: str | None = None) -> str:
    env_at, var_at = scan.how_read(name)
    if name_in_tree and name == fetchcontent_dir_var(name_in_tree) and not env_at and not var_at:
        return f"{name} (-D only; FetchContent's own variable for {name_in_tree!r})"
    kinds = []
    if env_at:
        kinds.append(f"environment at {env_at[0]}")
    if var_at:
        kinds.append(f"-D at {var_at[0]}")
    return f"{name} ({', '.join(kinds) or 'not read'})"


def submodules_for(opts: SourceOptions, decl: Declaration | None) -> tuple[Submodules, str | None]:
    """(which submodules to pack, a warning when the image's setting contradicts the declaration)."""
    recurse = True if decl is None or decl.submodules_recurse is None else decl.submodules_recurse
    if decl is not None:
        asked = decl.submodule_paths  # None: GIT_SUBMODULES not given, FetchContent takes all
        asked_text = ("all (no GIT_SUBMODULES)" if asked is None else
                      ", ".join(asked) if asked else "none (GIT_SUBMODULES is empty)")
        asked_where = f"{decl.where}" + (f"; {decl.submodules_note}" if decl.submodules_note else "")
    setting = opts.submodules
    if setting is None:
        if decl is None:
            return Submodules([], recurse, "default for a top-level source (none)"), None
        return Submodules(asked, recurse, f"GIT_SUBMODULES of {decl.name!r} at {asked_where}"
                          if decl.submodules is not None else f"FetchContent's default for {decl.name!r} "
                          f"(no GIT_SUBMODULES at {decl.where}): all, recursively"), None
    want = None if setting is True else [] if setting is False else list(setting)
    sub = Submodules(want, True if setting is True else recurse, "image.yaml")
    if decl is None:
        return sub, None
    if want == asked or (want is not None and asked is not None and sorted(want) == sorted(asked)):
        return sub, None
    said = "true (all, recursively)" if setting is True else "false (none)" if setting is False else \
        "[" + ", ".join(want) + "]"
    warn = (f"{opts.name}: submodules: {said} in image.yaml, but {decl.name!r} at {decl.where} asks for "
            f"{asked_text}")
    if want is not None and asked is not None:
        missing = [p for p in asked if p not in want]
        extra = [p for p in want if p not in asked]
        if missing:
            warn += f"; the tarball lacks {', '.join(missing)}, which the build may need"
        if extra:
            warn += f"; it also packs {', '.join(extra)}, which the declaration does not ask for"
    elif want == [] or (want is not None and asked is None):
        warn += "; the tarball lacks what the build may need"
    else:
        warn += "; packing every submodule fetches (and may fail on) ones the build never uses"
    return sub, warn


def _norm_url(url: str | None) -> str:
    u = (url or "").strip().lower().rstrip("/")
    u = re.sub(r"\.git\Z", "", u)
    return re.sub(r"\A(?:https?|git|ssh)://(?:[^@/]+@)?", "", u)


def check(pins: dict, scans: dict[str, Scan], commits: dict[str, str], *, env_file: str, yaml_file: str,
          env_keys: set[str]) -> Result:
    """The check over every scanned source. ``pins``: name -> object with ``name``, ``repo`` and
    ``opts`` (SourceOptions). ``commits``: scanned source -> its composed commit (for messages)."""
    res = Result()
    for pname, scan in scans.items():
        p = pins[pname]
        commit = commits.get(pname, "")[:12]
        deps = {q.opts.declares.lower(): q for q in pins.values() if q.opts.dependency_of == pname}
        excluded_here: list[dict] = []
        for key, decl in sorted(scan.declarations.items()):
            if decl.alternatives:
                alts = "; ".join(f"{a.tag_value or a.tag or a.url} at {a.where}" for a in decl.alternatives)
                res.notices.append(f"{pname}: {decl.name!r} is declared more than once with other values: "
                                   f"{decl.tag_value or decl.tag or decl.url} at {decl.where}; {alts}")
            if decl.tag_resolved is not None and decl.tag_resolved.value is None:
                res.notices.append(f"{pname}: GIT_TAG {decl.tag} of {decl.name!r} at {decl.where} cannot be "
                                   f"resolved: {decl.tag_resolved.note}; the pin is not compared with it")
            reason = p.opts.excluded(decl.name)
            q = deps.get(key)
            if q is None and reason is not None:
                excluded_here.append({"name": decl.name, "reason": reason, "file": decl.file, "line": decl.line,
                                      "when": list(decl.when)})
                continue
            if q is None:
                res.problems.append(_undeclared(p, decl, commit, pins, env_file, env_keys))
                continue
            ov, err, sugg = override_for(scan, decl, q.opts.env, q.name, q.opts.declares)
            if err:
                shown = ", ".join(describe_read(scan, n, decl.name) for n in sugg) or "none"
                res.problems.append(Problem(
                    yaml_file, f"{err} at {commit} ({pname} never reads it, so the build would not use the "
                    "prefetched tarball)", line=q.opts.line, key=f"sources.{q.name}.env",
                    hint=f"names {pname} reads for {decl.name!r}: {shown}"))
            subs, warn = submodules_for(q.opts, decl)
            if warn:
                res.notices.append(warn)
            res.deps[q.name] = DepInfo(decl, ov, subs)
        for n, reason in p.opts.exclude:
            if n.lower() not in scan.declarations:
                res.notices.append(f"{pname}: image.yaml excludes {n!r} ({reason}), but {pname} at {commit} "
                                   "declares no such FetchContent dependency")
        for key, q in sorted(deps.items()):
            if key not in scan.declarations:
                res.notices.append(f"{q.name}: image.yaml says it is a dependency of {pname} declared as "
                                   f"{q.opts.declares!r}, but {pname} at {commit} declares no such FetchContent "
                                   "dependency")
                if q.opts.env:
                    env_at, var_at = scan.how_read(q.opts.env)
                    ov = {"name": q.opts.env, "via": "env" if env_at or ENV_NAME_RE.match(q.opts.env) else "cmake",
                          "from": "image.yaml (not checked: no declaration)", "env_read_at": env_at[:_MAX_READ_AT],
                          "cmake_read_at": var_at[:_MAX_READ_AT]}
                else:
                    ov = None
                res.deps[q.name] = DepInfo(None, ov, submodules_for(q.opts, None)[0])
        res.excluded[pname] = excluded_here
    return res


def _undeclared(p, decl: Declaration, commit: str, pins: dict, env_file: str, env_keys: set[str]) -> Problem:
    upper = re.sub(r"[^A-Z0-9_]", "_", decl.name.upper())
    repo = decl.repository_value or decl.repository
    what = (f"GIT_REPOSITORY {repo}" if decl.repository else f"URL {decl.url}" if decl.url
            else f"SOURCE_DIR {decl.source_dir}")
    tag = decl.tag_value
    tag_text = ""
    if decl.tag:
        tag_text = f", GIT_TAG {decl.tag}" + (f" = {tag}" if tag and tag != decl.tag else "")
    kind = "FetchContent_Populate" if decl.kind == "populate" else "FetchContent dependency"
    under = _when(decl)
    msg = (f"{p.name} declares the {kind} {decl.name!r} at {decl.where} ({what}{tag_text}) in commit {commit}"
           + (f", under {under}" if under else "") + ", but nothing pins or excludes it: the build would fetch it "
           "from the network")
    existing = next((q for q in pins.values() if repo and _norm_url(q.repo) == _norm_url(repo)), None)
    name = existing.name if existing else upper
    guards = guard_names(decl)
    override = decl.override or (fetchcontent_dir_var(decl.name) if decl.kind == "declare" else
                                 guards[0] if guards else "<the variable the tree reads>")
    entry = f"sources: {{{name}: {{dependency_of: {p.name}, declares: {decl.name}, env: {override}}}}}"
    if existing is not None or f"{upper}_REPO" in env_keys:
        hint = (f"versions.env already has {name}_REPO: link it in image.yaml with '{entry}'")
    else:
        ref = tag if tag else "<40-hex sha>"
        hint = (f"add to {env_file}: '{upper}_REPO={repo or '<git url>'}' and '{upper}_REF={ref}' "
                f"(prefetch pins it), and to image.yaml '{entry}'")
    hint += (f"; or, if this image does not need it, exclude it with a reason: "
             f"'sources: {{{p.name}: {{exclude: {{{decl.name}: \"<why>\"}}}}}}'")
    return Problem(env_file, msg, key=f"{upper}_REPO", hint=hint)
