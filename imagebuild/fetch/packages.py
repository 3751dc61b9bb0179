"""Prefetch the package artifacts of an image: base images by digest, wheels, apt packages.

After this, no stage that installs packages needs the network: each one gets its wheels and
debs as BuildKit named contexts (``imagebuild-wheels``, ``imagebuild-apt``; contracts §3) and
installs them with no index, checking hashes. Three steps, each writing its own lock section
(``lock.update_sections``):

- ``prefetch_images``: every base image given by tag is resolved to its digest (the local
  engine's RepoDigests, else ``docker buildx imagetools inspect`` for the definition's platform),
  pinned in place in versions.env, and made present in the engine (pulled by digest when it is
  not); section ``images``.
- ``prefetch_wheels``: per stage with ``requirements:``, the requirement set is resolved as a whole
  for the definition's platform and Python (not the host's), with the parent stages' locked pins as
  constraints (``fetch/resolve.py``: uv's ``pip compile``); a set that does not resolve is refused.
  Then ``pip download --no-deps`` of exactly the resolved versions into
  ``deps-src/<image>/wheels/<stage>/`` plus a generated, hashed ``requirements.txt``; section ``wheels``.
- ``prefetch_apt``: per stage with ``apt:``, the pinned base image runs once WITH network
  (``docker run --network host``, the only networked step, logged under the state folder) to
  resolve and download the exact versions and their dependencies into
  ``deps-src/<image>/apt/<stage>/``, with a flat repository index (``Packages``) and an
  ``install.sh`` the stage runs under ``--network none``; section ``apt``.

A stage whose lock entry matches its inputs and whose files are all present with the locked
sha256 is not downloaded again; a file that is missing or damaged is fetched again by its
exact version and must match the lock. Formats: docs/image-definition.md ("Python wheels, apt
packages and base images").
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from imagebuild.core import context as context_mod
from imagebuild.core import lazy, state
from imagebuild.core import lock as lock_mod
from imagebuild.core.errors import OperationFailed
from imagebuild.core.fsutil import (
    atomic_write_text,
    sha256_bytes,
    sha256_file,
)
from imagebuild.definition import pkgspec
from imagebuild.definition import reader as d
from imagebuild.plan.package_inputs import (  # noqa: F401  (FORMAT, lock_for_plan, stage_key_inputs: re-exported)
    FORMAT,
    _digest,
    _read_lock,
    apt_dir,
    apt_inputs,
    lock_for_plan,
    root_image,
    stage_key_inputs,
    wheel_inputs,
    wheels_dir,
)

# `plan` reads this module's digests only: what prefetch uses is imported when it runs
# (docs/cli.md, "Start-up time")
log = lazy.logger()
run_mod = lazy.module("imagebuild.core.run")
resolve_mod = lazy.module("imagebuild.fetch.resolve")
shlex = lazy.module("shlex")
shutil = lazy.module("shutil")
tempfile = lazy.module("tempfile")

WHEELS_CONTEXT = "imagebuild-wheels"
APT_CONTEXT = "imagebuild-apt"
WHEELS_MOUNT = "/imagebuild/wheels"
APT_MOUNT = "/imagebuild/apt"
REQUIREMENTS_FILE = "requirements.txt"
APT_INDEX = "Packages"
APT_INSTALL = "install.sh"
PIP_TIMEOUT_S = 3600
APT_TIMEOUT_S = 3600

_ARCH = {"linux/amd64": ("x86_64", "amd64"), "linux/arm64": ("aarch64", "arm64"),
         "linux/ppc64le": ("ppc64le", "ppc64el"), "linux/s390x": ("s390x", "s390x")}
_WHEEL_RE = lazy.compile(r"(?P<name>[^-]+)-(?P<version>[^-]+)(?:-(?P<build>\d[^-]*))?-(?P<py>[^-]+)"
                       r"-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl\Z")


@dataclass
class Report:
    """What a package prefetch did: one line per image, stage and kind."""

    pinned: list[str] = field(default_factory=list)  # versions.env keys pinned now
    downloaded: list[str] = field(default_factory=list)  # files fetched over the network
    reused: list[str] = field(default_factory=list)  # files already there with the locked sha256
    pulled: list[str] = field(default_factory=list)  # images pulled into the engine
    steps: list[dict] = field(default_factory=list)
    offline: bool = False  # nothing may be downloaded or pulled: verify only

    def need_network(self, what: str) -> None:
        if self.offline:
            raise OperationFailed(f"{what}, but --offline was given",
                                  hint="run prefetch without --offline where the indexes and registries answer")

    def as_dict(self) -> dict:
        return {"pinned": self.pinned, "downloaded": self.downloaded, "reused": self.reused,
                "pulled": self.pulled, "steps": self.steps}


# ---------------------------------------------------------------------------------------------
# small helpers


def wheel_platform_tags(platform: str, glibc: str) -> list[str]:
    """The manylinux tags a glibc-``glibc`` system on ``platform`` accepts, newest first.

    pip does not expand PEP 600 tags (manylinux_2_X) to older levels, so every level is given.
    """
    arch = _ARCH.get(platform, (None,))[0]
    if arch is None:
        raise OperationFailed(f"no wheel platform tags known for {platform}",
                              hint="supported: " + ", ".join(sorted(_ARCH)))
    newest = int(glibc.split(".")[1])
    oldest = 5 if arch == "x86_64" else 17
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(newest, oldest - 1, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags += [f"{legacy[m]}_{arch}" for m in (17, 12, 5) if oldest <= m <= newest]
    return tags


def parse_wheel_name(filename: str) -> tuple[str, str]:
    m = _WHEEL_RE.match(filename)
    if not m:
        raise OperationFailed(f"not a wheel file name: {filename}")
    return pkgspec.normalise(m.group("name")), m.group("version")


def _rel(defn: d.Definition, path: Path) -> str:
    return d.display_path(defn.root, path)


def _log_dir(defn: d.Definition) -> Path:
    return state.state_dir(defn.root) / "prefetch" / defn.name


# ---------------------------------------------------------------------------------------------
# base images


def image_keys(defn: d.Definition) -> list[str]:
    """versions.env keys that hold base images: stage ``from:`` keys and ``FROM ${KEY}`` keys."""
    keys = set(defn.images)
    for st in defn.stages:
        for fr in st.parsed.froms:
            var = fr.variable
            if var and var != d.ARG_PARENT and not var.startswith(d.STAGE_ARG_PREFIX) and defn.env.get(var):
                keys.add(var)
    return sorted(keys)


def _inspect_local(ref: str) -> dict | None:
    proc = run_mod.run(["docker", "image", "inspect", ref], check=False, timeout=60)
    if proc.returncode != 0:
        return None
    text = proc.stdout.decode("utf-8", "replace")
    try:
        return json.loads(text[text.index("["):])[0]
    except (ValueError, IndexError, json.JSONDecodeError):
        return None


def _platform_of(info: dict) -> str:
    plat = f"{info.get('Os', '')}/{info.get('Architecture', '')}"
    return plat + (f"/{info['Variant']}" if info.get("Variant") and not plat.endswith("arm64") else "")


def _registry_digest(ref: str, platform: str) -> str | None:
    """The manifest digest of ``ref`` for ``platform`` from its registry; None when unreachable."""
    proc = run_mod.run(["docker", "buildx", "imagetools", "inspect", "--raw", ref], check=False, timeout=120)
    if proc.returncode != 0:
        log.debug("imagetools inspect %s: %s", ref, proc.stdout.decode("utf-8", "replace").strip()[-300:])
        return None
    raw = proc.stdout
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if "manifests" in doc:  # an index: pick the platform's manifest
        os_, _, arch = platform.partition("/")
        arch, _, variant = arch.partition("/")
        for m in doc["manifests"]:
            p = m.get("platform") or {}
            if p.get("os") == os_ and p.get("architecture") == arch and (not variant or p.get("variant") == variant):
                return m["digest"]
        raise OperationFailed(f"{ref}: the registry has no {platform} image",
                              hint="platforms there: " + ", ".join(
                                  f"{(m.get('platform') or {}).get('os')}/{(m.get('platform') or {}).get('architecture')}"
                                  for m in doc["manifests"]))
    # a single manifest: its digest is that of the exact bytes the registry served
    if "config" not in doc:
        raise OperationFailed(f"{ref}: the registry served neither an index nor an image manifest")
    return "sha256:" + sha256_bytes(raw)


def _local_digest(ref: d.ImageRef, info: dict) -> str | None:
    want = ref.name
    for rd in info.get("RepoDigests") or []:
        name, _, digest = rd.partition("@")
        if name in (want, f"docker.io/{want}", f"docker.io/library/{want}") or want.endswith("/" + name):
            return digest
    return None


def prefetch_images(defn: d.Definition, report: Report | None = None) -> dict:
    """Pin every base image by digest in versions.env, make sure each is in the engine, and
    write the lock's ``images`` section. Returns the section."""
    report = report if report is not None else Report()
    updates: dict[str, str] = {}
    section: dict[str, dict] = {}
    if image_keys(defn):  # every base is looked up in the engine: without one, say that (not "its registry")
        from imagebuild.core import engine as engine_mod

        info = engine_mod.probe()
        if not info.reachable:
            raise engine_mod.unreachable_error(info)
    for key in image_keys(defn):
        ref, msg = d.parse_image_ref(key, defn.env.get(key) or "")
        if msg:
            raise OperationFailed(f"{defn.env.display}: {key}: {msg}")
        digest = ref.digest
        if digest is None:
            digest = _resolve_tag(defn, ref, report)
            pinned = f"{ref.name}{':' + ref.tag if ref.tag else ''}@{digest}"
            updates[key] = pinned
            report.pinned.append(f"{key}={pinned}")
            log.info("pinned %s: %s -> %s", key, ref.value, digest)
        full = f"{ref.name}{':' + ref.tag if ref.tag else ''}@{digest}"
        info = _ensure_present(defn, key, ref.name, digest, report)
        if _platform_of(info) != defn.platform:
            raise OperationFailed(
                f"{defn.env.display}: {key}: {full} is {_platform_of(info)}, but the definition targets "
                f"{defn.platform}", hint=f"pin the {defn.platform} manifest (docker pull --platform {defn.platform})")
        from imagebuild.core.identity import from_inspect

        section[key] = {"ref": full, "name": ref.name, "tag": ref.tag, "digest": digest,
                        "platform": defn.platform, "identity": from_inspect(info).digest}
        report.steps.append({"kind": "image", "key": key, "ref": full})
    if updates:
        defn.env.update(updates)
    lock_mod.update_sections(defn.dir, defn.name, {"images": section})
    return section


def _resolve_tag(defn: d.Definition, ref: d.ImageRef, report: Report) -> str:
    tagged = f"{ref.name}:{ref.tag or 'latest'}"
    info = _inspect_local(tagged)
    if info is not None:
        if _platform_of(info) != defn.platform:
            raise OperationFailed(
                f"{defn.env.display}: {ref.key}: the local {tagged} is {_platform_of(info)}, the definition "
                f"targets {defn.platform}",
                hint=f"docker pull --platform {defn.platform} {tagged}, or pin its digest for {defn.platform} "
                "in versions.env")
        digest = _local_digest(ref, info)
        if digest:
            return digest
    if ref.key in defn.verified_bases:
        where = "has no repository digest" if info is not None else "is not in the engine"
        raise OperationFailed(
            f"{defn.env.display}: {ref.key}: {tagged} {where}, and the definition marks this base as verified "
            "(image.yaml verified_bases): a tag asked of its registry names whatever it points at today, not "
            "the image the lane was verified on, so it is not resolved there",
            hint=f"run prefetch against the engine that holds the verified image (imagebuild --engine ssh://<node> "
            f"prefetch {defn.name}), or write its digest into versions.env: {ref.key}={tagged}@sha256:<64 hex>")
    report.need_network(f"{ref.key}: {tagged} is not in the local engine; its registry must be asked")
    digest = _registry_digest(tagged, defn.platform)
    if digest:
        return digest
    raise OperationFailed(
        f"{defn.env.display}: {ref.key}: cannot resolve {tagged} to a digest: not in the local engine "
        "(or without a repository digest) and its registry does not answer",
        hint=f"pull it on a networked machine (docker pull --platform {defn.platform} {tagged}) or write "
        "its digest into versions.env: NAME:TAG@sha256:<64 hex>")


def _ensure_present(defn: d.Definition, key: str, name: str, digest: str, report: Report) -> dict:
    by_digest = f"{name}@{digest}"
    info = _inspect_local(by_digest)
    if info is not None:
        return info
    report.need_network(f"{key}: {by_digest} is not in the local engine and must be pulled")
    log.info("pulling %s (%s)", by_digest, defn.platform)
    proc = run_mod.run(["docker", "pull", "--platform", defn.platform, by_digest], check=False, timeout=3600)
    if proc.returncode != 0:
        tail = proc.stdout.decode("utf-8", "replace").strip().splitlines()[-1:]
        raise OperationFailed(f"{defn.env.display}: {key}: {by_digest} is not in the local engine and cannot be "
                              f"pulled: {' '.join(tail)}",
                              hint="load it (docker load) or pull it where the registry is reachable")
    report.pulled.append(by_digest)
    info = _inspect_local(by_digest)
    if info is None:
        raise OperationFailed(f"{by_digest} was pulled but the engine does not show it")
    return info


# ---------------------------------------------------------------------------------------------
# wheels


def _pip_env() -> dict[str, str]:
    # only the definition's indexes count: no pip.conf, no PIP_* from the host (pip's configured
    # index, where the definition asks for it, is read once and passed as a URL: pip_index_args)
    return {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


_configured: list = []


def configured_index_url() -> str | None:
    """pip's configured index URL for downloads (``pip config list``: PIP_INDEX_URL, then the
    [download] and [global] sections), None when nothing is configured (pip's own default)."""
    if not _configured:
        proc = run_mod.run([sys.executable, "-m", "pip", "config", "list"], check=False, timeout=60)
        found = {}
        for line in proc.stdout.decode("utf-8", "replace").splitlines():
            key, eq, value = line.partition("=")
            if eq:
                found[key.strip()] = value.strip().strip("'\"")
        _configured.append(next((found[k] for k in (":env:.index-url", "download.index-url", "global.index-url")
                                 if found.get(k)), None))
    return _configured[0]


def pip_index_args(index: pkgspec.Index, extras: tuple) -> list[str]:
    """``--index-url`` / ``--extra-index-url`` for the definition's indexes. pip's configured index
    (an Index without URL) becomes the configured URL; when none is configured, pip's own default is
    the main index (no --index-url) and every other index an extra one (pip ranks them all alike)."""
    urls = [ix.url if ix.url is not None else configured_index_url() for ix in (index, *extras)]
    if None in urls:
        return [a for u in dict.fromkeys(u for u in urls if u) for a in ("--extra-index-url", u)]
    urls = list(dict.fromkeys(urls))
    return ["--index-url", urls[0]] + [a for u in urls[1:] for a in ("--extra-index-url", u)]


def _pip_download(defn: d.Definition, stage: d.Stage, specs: list[str], dest: Path, *, no_deps: bool) -> str:
    py = defn.python
    req = stage.requirements
    index = req.index or py.index
    extras = req.extra_indexes if req.extra_indexes is not None else py.extra_indexes
    argv = [sys.executable, "-m", "pip", "download", "--isolated", "--disable-pip-version-check",
            "--only-binary=:all:", "--implementation", "cp", "--python-version", py.version, "--abi", py.abi,
            "--progress-bar", "off", "--cache-dir", str(state.state_dir(defn.root) / "pip-cache"),
            *pip_index_args(index, extras), "-d", str(dest)]
    for tag in wheel_platform_tags(defn.platform, py.glibc):
        argv += ["--platform", tag]
    if no_deps:
        argv.append("--no-deps")
    spec_file = dest / ".imagebuild-requirements.in"
    spec_file.write_text("".join(s + "\n" for s in specs), encoding="utf-8")
    argv += ["-r", str(spec_file)]
    proc = run_mod.run(argv, check=False, env=_pip_env(), timeout=PIP_TIMEOUT_S)
    spec_file.unlink()
    out = proc.stdout.decode("utf-8", "replace")
    if proc.returncode != 0:
        raise _pip_error(defn, stage, out)
    return out


def _pip_error(defn: d.Definition, stage: d.Stage, out: str) -> OperationFailed:
    req = stage.requirements
    target = (f"{defn.platform}, CPython {defn.python.version}, manylinux glibc <= {defn.python.glibc}")
    m = re.search(r"Could not find a version that satisfies the requirement (?P<req>.+?) "
                  r"\(from versions: (?P<versions>[^)]*)\)", out)
    if m:
        wanted = m.group("req").strip()
        name = re.split(r"[\s<>=!~\[(;]", wanted, maxsplit=1)[0]
        line = next((f":{r.line}" for r in req.items if r.key == pkgspec.normalise(name)), "")
        versions = m.group("versions").strip()
        direct = bool(line)
        what = f"{req.display}{line}: {wanted}" if direct else f"{wanted} (a dependency of {req.display})"
        if versions == "none":
            return OperationFailed(
                f"stage {stage.name!r}: no binary wheel of {what} for the target ({target})",
                hint="the index has no wheel of it for this platform and Python at all; build it into a wheel "
                "in an earlier stage, or use another index (python.index_url / extra_index_urls)")
        return OperationFailed(
            f"stage {stage.name!r}: no binary wheel of {what} for the target ({target}); versions with a "
            f"wheel for it: {versions}",
            hint="pin one of those versions (the version may not exist, or have no wheel for this target)")
    tail = "\n".join("  | " + ln for ln in out.strip().splitlines()[-15:])
    return OperationFailed(f"stage {stage.name!r}: pip download failed for {req.display}:\n{tail}",
                           hint="is the index reachable? (the index URLs come from versions.env via image.yaml)")


def _indexes(defn: d.Definition, stage: d.Stage) -> tuple[pkgspec.Index, tuple]:
    req = stage.requirements
    py = defn.python
    return req.index or py.index, req.extra_indexes if req.extra_indexes is not None else py.extra_indexes


def _resolve(defn: d.Definition, st: d.Stage, parents: list) -> list[tuple[str, str]]:
    """The stage's whole set for the target (fetch/resolve.py). Where the resolver finds no version
    or no wheel of a requirement, pip's answer for it (the versions that do have one) is the error."""
    try:
        return resolve_mod.resolve(defn, st, pip_index_args(*_indexes(defn, st)), parents)
    except resolve_mod.Unavailable as exc:
        tmp = Path(tempfile.mkdtemp(prefix=f".why-{st.name}-", dir=_mkdir(state.state_dir(defn.root))))
        try:
            _pip_download(defn, st, exc.specs, tmp, no_deps=True)  # raises pip's message when it fails too
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_author_hashes(stage: d.Stage, files: dict[str, Path]) -> None:
    req = stage.requirements
    by_name: dict[str, list[Path]] = {}
    for fn, p in files.items():
        by_name.setdefault(parse_wheel_name(fn)[0], []).append(p)
    for r in req.items:
        if not r.hashes:
            continue
        for p in by_name.get(r.key, []):
            got = sha256_file(p)
            if got not in r.hashes:
                raise OperationFailed(
                    f"{req.display}:{r.line}: {r.spec()}: the index served {p.name} with sha256 {got}, which is "
                    f"not a hash the file lists ({', '.join(h[:12] + '...' for h in r.hashes)})",
                    hint="a wrong or outdated --hash, or the index changed the file: check which one before "
                    "trusting it")


def _check_programs_run(defn: d.Definition, st: d.Stage, files: dict[str, Path]) -> None:
    """A wheel's programs (fetch/toolwheels.py) must run on the definition's glibc: refused here, before
    the set reaches deps-src, rather than when the gate first runs the program."""
    glibc = defn.python.glibc if defn.python else None
    if not glibc:
        return
    from imagebuild.fetch import toolwheels

    bad = [(fn, prog, need) for fn, p in files.items() for prog, need in toolwheels.programs_too_new(p, glibc)]
    if bad:
        lines = "; ".join(f"{fn}: {prog} needs glibc {need}" for fn, prog, need in bad)
        raise OperationFailed(
            f"stage {st.name!r}: {len(bad)} program(s) of the resolved set cannot run on the stage's glibc "
            f"{glibc} (python.glibc in {defn.name}/image.yaml), although their wheels' tags allow it: {lines}",
            hint="pin a version of that package whose program runs there, or build on a base with a newer glibc "
            "(and raise python.glibc); nothing was written")


def _write_requirements(defn: d.Definition, stage: d.Stage, dest: Path, wheels: list[dict]) -> str:
    lines = [f"# generated by imagebuild prefetch from {stage.requirements.display}: do not edit\n",
             f"# pip install --no-index --find-links {WHEELS_MOUNT} --require-hashes "
             f"-r {WHEELS_MOUNT}/{REQUIREMENTS_FILE}\n"]
    for w in wheels:
        lines.append(f"{w['name']}=={w['version']} --hash=sha256:{w['sha256']}\n")
    text = "".join(lines)
    atomic_write_text(dest / REQUIREMENTS_FILE, text)
    return sha256_bytes(text.encode())


def prefetch_wheels(defn: d.Definition, report: Report | None = None) -> dict:
    """Resolve every stage's requirement set as a whole for the target (with its parents' pins as
    constraints: fetch/resolve.py), then download exactly those sets; write the lock's ``wheels``
    section. Every stage is resolved before anything is downloaded, so a refused set leaves no files
    and no lock behind. Stages come in build order: a parent's pins are known when its children resolve."""
    report = report if report is not None else Report()
    locked = _read_lock(defn).get("wheels") or {}
    pins: dict[str, list[tuple[str, str]]] = {}
    plans: dict[str, tuple[dict | None, list[tuple[str, str]] | None]] = {}
    for st in defn.stages:
        if st.requirements is None:
            continue
        parents = resolve_mod.parent_pins(defn, st, pins)
        constraints = _constraints_entry(parents)
        entry = locked.get(st.name)
        if _reusable(entry, _digest(wheel_inputs(defn, st)), constraints):
            pins[st.name] = [(pkgspec.normalise(w["name"]), w["version"]) for w in entry["files"]]
            plans[st.name] = (constraints, None)
        else:
            report.need_network(f"stage {st.name!r}: its wheels are not locked for {st.requirements.display} as it is")
            pins[st.name] = _resolve(defn, st, parents)
            plans[st.name] = (constraints, pins[st.name])
    for st in defn.stages:  # before anything is downloaded: the trees' own requirements
        if st.requirements is not None and st.requirements.satisfies:
            _check_tree_requirements(defn, st, pins, report)
    section: dict[str, dict] = {}
    for st in defn.stages:  # in build order: a parent's entry is known when its children are fetched
        if st.requirements is not None:
            section[st.name] = _stage_wheels(defn, st, locked.get(st.name), report, *plans[st.name],
                                             inherited=_inherited(defn, st, section))
    lock_mod.update_sections(defn.dir, defn.name, {"wheels": section})
    return section


def _inherited(defn: d.Definition, st: d.Stage, section: dict[str, dict]) -> dict[tuple[str, str], dict]:
    """(name, version) -> the file entry of the nearest stage above ``st`` that installs it: what ``st``
    finds installed in its parent image, and so never gets in its own folder or requirements file."""
    out: dict[tuple[str, str], dict] = {}
    cur = st
    while cur.parent.kind == "stage":
        cur = defn.stage(cur.parent.name)
        for w in (section.get(cur.name) or {}).get("files") or ():
            key = (pkgspec.normalise(w["name"]), w["version"])
            if key not in out and not w.get("from_stage"):
                out[key] = {**w, "from_stage": cur.name}
            elif key not in out:
                out[key] = dict(w)
    return out


def own_files(entry: dict) -> list[dict]:
    """The wheels a stage's own folder holds and its requirements file installs: those its parent image
    does not already have (``from_stage``: installed by that stage above it)."""
    return [w for w in entry.get("files") or () if not w.get("from_stage")]


def _reusable(entry: dict | None, inputs_sha: str, constraints: dict | None) -> bool:
    return bool(entry) and entry.get("inputs_sha256") == inputs_sha and isinstance(entry.get("files"), list) \
        and entry.get("constraints") == constraints


def _constraints_entry(pins: list) -> dict | None:
    """What the lock records of the parents' pins a stage was resolved against (None: no parent has wheels)."""
    if not pins:
        return None
    return {"stages": sorted({p.stage for p in pins}),
            "sha256": _digest({"pins": sorted((p.stage, p.name, p.version) for p in pins)})}


def _check_tree_requirements(defn: d.Definition, st: d.Stage, pins: dict, report: Report) -> None:
    """The set stage ``st`` ends with (its own pins and its parents') against the requirement files
    of the composed trees it names (fetch/treereqs.py); refused before any download."""
    from imagebuild.fetch import treereqs

    installed = {pkgspec.normalise(n): v for n, v in pins.get(st.name, ())}
    for pp in resolve_mod.parent_pins(defn, st, pins):
        installed.setdefault(pkgspec.normalise(pp.name), pp.version)
    sources = _read_lock(defn).get("sources") or {}
    env = treereqs.target_environment(defn.platform, defn.python.version if defn.python else "3.12")
    exceptions = dict(st.requirements.exceptions)
    problems, excepted, unused_all = [], [], None
    for source, files in st.requirements.satisfies:
        entry = sources.get(source)
        if not isinstance(entry, dict) or not entry.get("tarball"):
            raise OperationFailed(f"stage {st.name!r}: requirements.satisfies names {source}, which the lock has "
                                  "no tarball of", hint=f"imagebuild prefetch {defn.name} (sources first)")
        reqs = treereqs.read_tree_requirements(defn.root / entry["tarball"], source, files)
        p, e, unused = treereqs.check(reqs, installed, exceptions, env)
        problems += p
        excepted += e
        unused_all = set(unused) if unused_all is None else unused_all & set(unused)
    if problems:
        raise treereqs.refuse(st.name, st.requirements.display, problems)
    for f in excepted:
        log.info("  stage %s: %s differs on purpose: %s", st.name, f.shown(), f.excepted)
    for name in sorted(unused_all or ()):
        log.warning("  warning: stage %r: requirements.exceptions lists %s, but the trees' requirements are met "
                    "without it: remove the exception", st.name, name)
    report.steps.append({"kind": "tree-requirements", "stage": st.name,
                         "excepted": [{"requirement": f.requirement.text, "installed": f.installed,
                                       "where": f"{f.requirement.source}:{f.requirement.file}:{f.requirement.line}",
                                       "reason": f.excepted} for f in excepted],
                         "unused_exceptions": sorted(unused_all or ())})


def _prefetch_section(defn: d.Definition, name: str, wanted, fetch_stage, report: Report | None) -> dict:
    """Run ``fetch_stage`` for each stage that ``wanted``; replace the lock section ``name``."""
    report = report if report is not None else Report()
    locked = _read_lock(defn).get(name) or {}
    section = {st.name: fetch_stage(defn, st, locked.get(st.name), report) for st in defn.stages if wanted(st)}
    lock_mod.update_sections(defn.dir, defn.name, {name: section})
    return section


def _restore_locked(defn: d.Definition, st: d.Stage, dest: Path, missing: list[dict], report: Report, *,
                    served_by: str, fetch, gone_hint: str, subdir: str = "") -> None:
    """Fetch the ``missing`` locked files again (``fetch(tmp)``), check each against its locked
    sha256 and move it into ``dest``. A file no longer served, or served with other bytes, is an
    error: the lock is the truth, never what the index or archive serves today."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{st.name}-", dir=_mkdir(dest.parent)))
    try:
        fetch(tmp)
        for f in missing:
            got_path = tmp / subdir / f["filename"]
            if not got_path.is_file():
                raise OperationFailed(f"stage {st.name!r}: the {served_by} no longer serves {f['filename']}",
                                      hint=gone_hint)
            got = sha256_file(got_path)
            if got != f["sha256"]:
                raise OperationFailed(
                    f"stage {st.name!r}: sha256 mismatch for {f['filename']}: the lock "
                    f"({_rel(defn, lock_mod.lock_path(defn.dir))}) says {f['sha256']}, the {served_by} "
                    f"served {got}", hint=f"the {served_by} changed a published file (or the lock was edited); "
                    "find out which before trusting it")
            _mkdir(dest)
            os.replace(got_path, dest / f["filename"])
            report.downloaded.append(f["filename"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stage_wheels(defn: d.Definition, st: d.Stage, entry: dict | None, report: Report, constraints: dict | None,
                  resolved: list[tuple[str, str]] | None, *, inherited: dict | None = None) -> dict:
    """Check or fetch the stage's wheels: the locked ones (``resolved`` None), else the resolved set. A
    wheel a stage above installs (``inherited``) is recorded with ``from_stage`` and neither downloaded
    again nor put in this stage's folder: each wheel is stored, and sent to a build, once."""
    inputs = wheel_inputs(defn, st)
    inputs_sha = _digest(inputs)
    dest = wheels_dir(defn, st.name)
    inherited = inherited or {}
    if resolved is None:
        own = own_files(entry)
        missing = [w for w in own if not _has(dest / w["filename"], w["sha256"])]
        if missing:
            report.need_network(f"stage {st.name!r}: {len(missing)} locked wheel(s) are missing or damaged")
            log.info("stage %s: fetching %d missing wheel(s) again by exact version", st.name, len(missing))
            _restore_locked(
                defn, st, dest, missing, report, served_by="index",
                fetch=lambda tmp: _pip_download(defn, st, [f"{w['name']}=={w['version']}" for w in missing], tmp,
                                                no_deps=True),
                gone_hint="re-resolve: change or touch the requirements, or delete the stage's entry in lock.json")
        for w in own:
            if w not in missing:
                report.reused.append(w["filename"])
        req_sha = _write_requirements(defn, st, dest, own) if not _has(
            dest / REQUIREMENTS_FILE, entry["install_requirements"]["sha256"]) else entry["install_requirements"][
            "sha256"]
        _remove_extras(dest, {w["filename"] for w in own} | {REQUIREMENTS_FILE})
        report.steps.append({"kind": "wheels", "stage": st.name, "downloaded": len(missing),
                             "files": len(entry["files"])})
        return {**entry, "install_requirements": {**entry["install_requirements"], "sha256": req_sha}}

    from_parents = [inherited[(pkgspec.normalise(n), v)] for n, v in resolved if (pkgspec.normalise(n), v) in inherited]
    to_fetch = [(n, v) for n, v in resolved if (pkgspec.normalise(n), v) not in inherited]
    log.info("stage %s: downloading the %d wheel(s) of the resolved set%s", st.name, len(to_fetch),
             f" ({len(from_parents)} more are installed by the stages above it)" if from_parents else "")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{st.name}-", dir=_mkdir(dest.parent)))
    try:
        if to_fetch:
            _pip_download(defn, st, [f"{n}=={v}" for n, v in to_fetch], tmp, no_deps=True)
        files = {p.name: p for p in sorted(tmp.iterdir()) if p.is_file()}
        stray = [n for n in files if not n.endswith(".whl")]
        if stray:
            raise OperationFailed(f"stage {st.name!r}: pip fetched non-wheel files: {', '.join(stray)}")
        _check_author_hashes(st, files)
        _check_programs_run(defn, st, files)
        requested = {r.key for r in st.requirements.items}
        wheels = []
        for fn, p in files.items():
            name, version = parse_wheel_name(fn)
            old = dest / fn
            sha = sha256_file(p)
            if _has(old, sha):
                report.reused.append(fn)
            else:
                report.downloaded.append(fn)
            wheels.append({"filename": fn, "name": name, "version": version, "sha256": sha,
                           "size": p.stat().st_size, "requested": name in requested})
        missing = {n for n, _ in to_fetch} - {w["name"] for w in wheels}
        if missing:
            raise OperationFailed(f"stage {st.name!r}: pip returned no wheel for {', '.join(sorted(missing))}")
        own = sorted(wheels, key=lambda w: (w["name"], w["filename"]))
        wheels = sorted(own + [{**w, "requested": w["name"] in requested} for w in from_parents],
                        key=lambda w: (w["name"], w["filename"]))
        _swap_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    req_sha = _write_requirements(defn, st, dest, own)
    py = defn.python
    entry = {"inputs_sha256": inputs_sha, "requirements": st.requirements.display,
             "requirements_sha256": st.requirements.sha256, "python": py.version, "glibc": py.glibc,
             "platform": defn.platform, "index_url": inputs["index_url"],
             "extra_index_urls": inputs["extra_index_urls"], "resolver": resolve_mod.uv_version(),
             "constraints": constraints, "dir": _rel(defn, dest), "files": wheels,
             "install_requirements": {"path": _rel(defn, dest / REQUIREMENTS_FILE), "sha256": req_sha}}
    report.steps.append({"kind": "wheels", "stage": st.name, "resolved": True, "files": len(wheels)})
    return entry


def _has(path: Path, sha: str) -> bool:
    return path.is_file() and sha256_file(path) == sha


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _swap_dir(new: Path, dest: Path) -> None:
    """Replace ``dest`` by ``new`` (same parent) so that a reader never sees a half-filled folder."""
    old = None
    if dest.exists():
        old = dest.with_name(f".old-{dest.name}-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
    os.replace(new, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    new.mkdir()  # the caller removes its temp folder


def _remove_extras(dest: Path, keep: set[str]) -> None:
    for p in dest.iterdir() if dest.is_dir() else ():
        if p.name not in keep:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()


# ---------------------------------------------------------------------------------------------
# apt


_APT_SCRIPT = r"""
set -eu
exec 2>&1
snap="${IMAGEBUILD_APT_SNAPSHOT:-}"
set -- -o Dir::Cache::Archives=/out/archives -o APT::Sandbox::User=root -o Acquire::Retries=3
if [ -n "$snap" ]; then
  v=$(apt-get --version | sed -n '1s/^apt \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  set -- "$@" -o APT::Snapshot="$snap"
  case "$v" in "1 "*|"2 "[0-6]) echo "IMAGEBUILD-ERROR: apt $v has no snapshot support"; exit 3;; esac
fi
mkdir -p /out/archives/partial /out/control
echo "+ apt-get update"
apt-get "$@" update -q
echo "+ apt-get $IMAGEBUILD_APT_MODE $IMAGEBUILD_APT_PACKAGES"
if [ "$IMAGEBUILD_APT_MODE" = download ]; then
  (cd /out/archives && apt-get "$@" download $IMAGEBUILD_APT_PACKAGES)
else
  DEBIAN_FRONTEND=noninteractive apt-get "$@" install -y -q --download-only --no-install-recommends \
    $IMAGEBUILD_APT_PACKAGES
fi
for f in /out/archives/*.deb; do
  [ -e "$f" ] || continue
  dpkg-deb -f "$f" > "/out/control/$(basename "$f").control"
done
dpkg --print-architecture > /out/arch
rm -rf /out/archives/partial /out/archives/lock
chown -R "$IMAGEBUILD_UID:$IMAGEBUILD_GID" /out
"""


def _apt_run(defn: d.Definition, st: d.Stage, base: str, specs: list[str], out: Path, mode: str) -> None:
    """Run the pinned base image WITH network, once, to fetch ``specs`` into ``out`` (logged)."""
    argv = ["docker", "run", "--rm", "--network", "host", "--platform", defn.platform,
            "-v", f"{out}:/out", "-e", f"IMAGEBUILD_APT_PACKAGES={' '.join(specs)}",
            "-e", f"IMAGEBUILD_APT_MODE={mode}", "-e", f"IMAGEBUILD_APT_SNAPSHOT={defn.apt_snapshot or ''}",
            "-e", f"IMAGEBUILD_UID={os.getuid()}", "-e", f"IMAGEBUILD_GID={os.getgid()}",
            "--entrypoint", "/bin/sh", base, "-c", _APT_SCRIPT]
    log_path = _log_dir(defn) / f"apt-{st.name}.log"
    log.info("stage %s: apt %s of %d package(s) in %s (network: host; log %s)", st.name, mode, len(specs), base,
             d.display_path(defn.root, log_path))
    proc = run_mod.run(argv, check=False, timeout=APT_TIMEOUT_S)
    text = proc.stdout.decode("utf-8", "replace")
    shown = [a if a != _APT_SCRIPT else "<script>" for a in argv]
    atomic_write_text(log_path, f"+ {shlex.join(shown)}\n{text}\n# exit {proc.returncode}\n")
    if proc.returncode != 0:
        raise _apt_error(defn, st, base, text, log_path)


def _apt_error(defn, st, base, text, log_path) -> OperationFailed:
    lst = st.apt
    where = d.display_path(defn.root, log_path)

    def line_of(name):
        return next((f":{p.line}" for p in lst.items if p.name == name), "")

    m = re.search(r"Version '(?P<ver>[^']+)' for '(?P<name>[^']+)' was not found", text)
    if m:
        return OperationFailed(
            f"{lst.display}{line_of(m.group('name'))}: {m.group('name')}={m.group('ver')}: no such version in the "
            f"archive of {base} ({defn.platform})",
            hint=f"`docker run --rm {base} apt-cache policy {m.group('name')}` (after apt-get update) lists the "
            f"versions; log: {where}")
    m = re.search(r"Unable to locate package (?P<name>\S+)", text)
    if m:
        return OperationFailed(f"{lst.display}{line_of(m.group('name'))}: no package {m.group('name')!r} in the "
                               f"archive of {base} ({defn.platform})", hint=f"check the name; log: {where}")
    m = re.search(r"IMAGEBUILD-ERROR: (.*)", text)
    if m:
        return OperationFailed(f"stage {st.name!r}: apt_snapshot {defn.apt_snapshot}: {m.group(1)} in {base}",
                               hint="snapshots need apt >= 2.7 (Ubuntu 24.04, Debian 13); remove apt_snapshot "
                               "for older bases")
    if "exec format error" in text:
        return OperationFailed(f"stage {st.name!r}: cannot run {base} ({defn.platform}) on this host",
                               hint="prefetch apt packages on a host of the target architecture (or install "
                               "qemu binfmt emulation)")
    tail = "\n".join("  | " + ln for ln in text.strip().splitlines()[-15:])
    return OperationFailed(f"stage {st.name!r}: apt download in {base} failed:\n{tail}",
                           hint=f"full log: {where}; is the distribution's mirror reachable from this host?")


def _read_debs(out: Path) -> tuple[str, dict[str, tuple[Path, str]]]:
    arch = (out / "arch").read_text().strip() if (out / "arch").is_file() else ""
    debs = {}
    for p in sorted((out / "archives").glob("*.deb")):
        ctl = (out / "control" / f"{p.name}.control").read_bytes().decode("utf-8", "replace")
        debs[p.name] = (p, ctl)
    return arch, debs


def _control_field(ctl: str, name: str) -> str:
    m = re.search(rf"^{name}:\s*(.*)$", ctl, re.M)
    return m.group(1).strip() if m else ""


def _write_apt_repo(st: d.Stage, dest: Path, packages: list[dict], controls: dict[str, str]) -> dict:
    """``Packages`` (a flat repository index) and ``install.sh`` in ``dest``."""
    paras = []
    for p in packages:
        ctl = controls[p["filename"]].strip("\n")
        ctl = "\n".join(ln for ln in ctl.splitlines()
                        if not re.match(r"(Filename|Size|SHA256|MD5sum|SHA1|SHA512):", ln))
        paras.append(f"{ctl}\nFilename: ./{p['filename']}\nSize: {p['size']}\nSHA256: {p['sha256']}\n")
    index = "\n".join(paras)
    specs = " ".join(a.spec() for a in st.apt.items)
    script = f"""#!/bin/sh
# generated by imagebuild prefetch from {st.apt.display}: do not edit
# Installs the stage's apt packages from this folder, offline:
#   RUN --mount=type=bind,from={APT_CONTEXT},target={APT_MOUNT} sh {APT_MOUNT}/{APT_INSTALL}
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
chmod 755 "$work"
mkdir -p "$work/lists/partial"
# only this folder is a source (the base image's own sources are not consulted)
echo "deb [trusted=yes] file:$here ./" > "$work/sources.list"
set -- -o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null \\
  -o Dir::State::Lists="$work/lists" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= \\
  -o Acquire::Languages=none
apt-get "$@" update -q
DEBIAN_FRONTEND=noninteractive apt-get "$@" install -y -q --no-install-recommends {specs}
rm -rf "$work"
"""
    for name, text in ((APT_INDEX, index), (APT_INSTALL, script)):
        atomic_write_text(dest / name, text, mode=0o755 if name == APT_INSTALL else 0o644)
    return {name: sha256_bytes(text.encode()) for name, text in ((APT_INDEX, index), (APT_INSTALL, script))}


def prefetch_apt(defn: d.Definition, report: Report | None = None) -> dict:
    """Download every stage's apt packages (with dependencies); write the lock's ``apt`` section."""
    return _prefetch_section(defn, "apt", lambda st: st.apt is not None, _stage_apt, report)


def _stage_apt(defn: d.Definition, st: d.Stage, entry: dict | None, report: Report) -> dict:
    base_ref = root_image(defn, st)
    if not base_ref.pinned:
        raise OperationFailed(f"stage {st.name!r}: base image {base_ref.key}={base_ref.value} is not pinned by "
                              "digest", hint="prefetch pins base images first (prefetch_images)")
    inputs = apt_inputs(defn, st)
    inputs_sha = _digest(inputs)
    dest = apt_dir(defn, st.name)
    gen = (APT_INDEX, APT_INSTALL)
    if entry and entry.get("inputs_sha256") == inputs_sha and isinstance(entry.get("files"), list):
        missing = [p for p in entry["files"] if not _has(dest / p["filename"], p["sha256"])]
        if missing:
            report.need_network(f"stage {st.name!r}: {len(missing)} locked deb(s) are missing or damaged")
            _restore_locked(
                defn, st, dest, missing, report, served_by="archive", subdir="archives",
                fetch=lambda tmp: _apt_run(defn, st, base_ref.value,
                                           [f"{p['name']}={p['version']}" for p in missing], tmp, "download"),
                gone_hint="set apt_snapshot to pin the archive, or re-resolve the stage")
        for p in entry["files"]:
            if p not in missing:
                report.reused.append(p["filename"])
        if not all(_has(dest / n, entry["generated"][n]) for n in gen):
            raise OperationFailed(f"stage {st.name!r}: the generated index in {_rel(defn, dest)} is missing or "
                                  "was changed", hint="delete the folder and run prefetch again")
        _remove_extras(dest, {p["filename"] for p in entry["files"]} | set(gen))
        report.steps.append({"kind": "apt", "stage": st.name, "downloaded": len(missing),
                             "files": len(entry["files"])})
        return entry

    report.need_network(f"stage {st.name!r}: its apt packages are not locked for {st.apt.display} as it is")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{st.name}-", dir=_mkdir(dest.parent)))
    try:
        _apt_run(defn, st, base_ref.value, [a.spec() for a in st.apt.items], tmp, "install")
        arch, debs = _read_debs(tmp)
        requested = {a.name for a in st.apt.items}
        packages, controls = [], {}
        repo = Path(tempfile.mkdtemp(prefix=f".new-{st.name}-", dir=dest.parent))
        for fn, (p, ctl) in debs.items():
            sha = sha256_file(p)
            (report.reused if _has(dest / fn, sha) else report.downloaded).append(fn)
            os.replace(p, repo / fn)
            controls[fn] = ctl
            packages.append({"filename": fn, "name": _control_field(ctl, "Package"),
                             "version": _control_field(ctl, "Version"),
                             "architecture": _control_field(ctl, "Architecture"), "sha256": sha,
                             "size": (repo / fn).stat().st_size,
                             "requested": _control_field(ctl, "Package") in requested})
        packages.sort(key=lambda x: (x["name"], x["filename"]))
        unpinned = [a for a in st.apt.items if a.version is None]
        if unpinned:  # a bare name: pin what the archive gave, in place; the lock keys the pinned file
            st, inputs_sha = _pin_apt_names(defn, st, unpinned, packages, report)
        generated = _write_apt_repo(st, repo, packages, controls)
        _swap_dir(repo, dest)
        shutil.rmtree(repo, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    entry = {"inputs_sha256": inputs_sha, "list": st.apt.display, "list_sha256": st.apt.sha256,
             "base": base_ref.value, "platform": defn.platform, "architecture": arch,
             "snapshot": defn.apt_snapshot, "dir": _rel(defn, dest), "files": packages, "generated": generated}
    report.steps.append({"kind": "apt", "stage": st.name, "resolved": True, "files": len(packages)})
    return entry


def _pin_apt_names(defn: d.Definition, st: d.Stage, unpinned: list, packages: list[dict], report: Report):
    """Write ``name=version`` for each bare name of the apt list (the version the pinned base's archive
    resolved, read from the downloaded .deb), comments and order kept, atomically; returns the stage
    re-read and its new inputs digest."""
    versions = {p["name"]: p["version"] for p in packages if p.get("requested")}
    lines = st.apt.path.read_text(encoding="utf-8").split("\n")
    for a in unpinned:
        v = versions.get(a.name)
        if not v:
            raise OperationFailed(f"{st.apt.display}:{a.line}: {a.name}: the archive installed no such package",
                                  hint=f"`apt-cache policy {a.name}` in the base image")
        pinned = f"{a.spec()}={v}"
        words = lines[a.line - 1].split("#", 1)
        body = re.sub(rf"(?<![^\s]){re.escape(a.spec())}(?![^\s])", pinned, words[0], count=1)
        lines[a.line - 1] = body + ("#" + words[1] if len(words) > 1 else "")
        report.pinned.append(f"{st.apt.display}:{a.line}: {pinned}")
        log.info("pinned %s in %s", pinned, st.apt.display)
    atomic_write_text(st.apt.path, "\n".join(lines))
    fresh = d.load(defn.root, defn.name).stage(st.name)
    return fresh, _digest(apt_inputs(defn, fresh))


# ---------------------------------------------------------------------------------------------
# the whole package prefetch, and the build's check


def has_packages(defn: d.Definition) -> bool:
    """Whether package prefetch has anything to do for ``defn``."""
    return bool(image_keys(defn)) or any(st.requirements or st.apt for st in defn.stages)


def prefetch_packages(ctx: context_mod.Context | Path, image: str, report: Report | None = None, *,
                      offline: bool = False) -> tuple[d.Definition, Report]:
    """Pin and fetch base images, then wheels and apt packages. Returns the (re-read) definition.

    ``offline``: download and pull nothing; fail when anything is missing (verification only).
    """
    report = report if report is not None else Report()
    report.offline = offline
    root = context_mod.of(ctx).root
    defn = d.load(root, image)
    prefetch_images(defn, report)
    if report.pinned:
        defn = d.load(root, image)  # versions.env changed
    if any(st.requirements for st in defn.stages):
        prefetch_wheels(defn, report)
    else:
        lock_mod.update_sections(defn.dir, defn.name, {"wheels": {}})
    if any(st.apt for st in defn.stages):
        prefetch_apt(defn, report)
    else:
        lock_mod.update_sections(defn.dir, defn.name, {"apt": {}})
    return defn, report


def summary(report: Report) -> dict:
    """The package part of the prefetch report (JSON: ``images[].packages``)."""
    return {"pinned": report.pinned, "pulled": report.pulled, "downloaded": len(report.downloaded),
            "reused": len(report.reused), "downloaded_files": report.downloaded, "steps": report.steps}


def render(s: dict) -> list[str]:
    """Lines for the text form of the prefetch report."""
    lines = [f"  pinned {p}" for p in s["pinned"]] + [f"  pulled {p}" for p in s["pulled"]]
    for step in s["steps"]:
        if step["kind"] == "image":
            lines.append(f"  image  {step['key']} = {step['ref']}")
        else:
            got = "resolved" if step.get("resolved") else f"{step.get('downloaded', 0)} fetched again"
            lines.append(f"  {step['kind']:<6} {step['stage']}: {step['files']} files ({got})")
    lines.append(f"  packages: {s['downloaded']} downloaded, {s['reused']} already there")
    return lines


def stage_contexts(defn: d.Definition, stage: str) -> dict[str, Path]:
    """The named build contexts of ``stage`` (``imagebuild-wheels``, ``imagebuild-apt``), after
    checking every file against the lock. Raises OperationFailed when anything is stale or wrong."""
    st = defn.stage(stage)
    if st.requirements is None and st.apt is None:
        return {}
    data = _read_lock(defn)
    out: dict[str, Path] = {}
    hint = f"run `imagebuild prefetch {defn.name}`"
    for kind, present, inputs_fn, ctx, dir_fn in (
            ("wheels", st.requirements, wheel_inputs, WHEELS_CONTEXT, wheels_dir),
            ("apt", st.apt, apt_inputs, APT_CONTEXT, apt_dir)):
        if present is None:
            continue
        entry = (data.get(kind) or {}).get(stage)
        if entry is None or entry.get("inputs_sha256") != _digest(inputs_fn(defn, st)):
            raise OperationFailed(f"stage {stage!r}: the lock's {kind} are missing or stale for its inputs",
                                  hint=hint)
        dest = dir_fn(defn, stage)
        expected = {f["filename"]: f["sha256"] for f in (own_files(entry) if kind == "wheels" else entry["files"])}
        if kind == "wheels":
            expected[REQUIREMENTS_FILE] = entry["install_requirements"]["sha256"]
        else:
            expected.update(entry["generated"])
        for fn, sha in sorted(expected.items()):
            p = dest / fn
            if not p.is_file():
                raise OperationFailed(f"stage {stage!r}: {_rel(defn, p)} is missing", hint=hint)
            got = sha256_file(p)
            if got != sha:
                raise OperationFailed(f"stage {stage!r}: sha256 mismatch for {_rel(defn, p)}: the lock says {sha}, "
                                      f"the file has {got}", hint=hint + " (it fetches the file again)")
        extra = sorted(p.name for p in dest.iterdir() if p.name not in expected)
        if extra:
            raise OperationFailed(f"stage {stage!r}: unexpected files in {_rel(defn, dest)}: {', '.join(extra)}",
                                  hint=hint + " (it removes them)")
        out[ctx] = dest
    return out


__all__ = ["Report", "prefetch_images", "prefetch_wheels", "prefetch_apt", "prefetch_packages", "has_packages",
           "summary", "render",
           "stage_contexts", "stage_key_inputs", "lock_for_plan", "wheel_platform_tags"]
