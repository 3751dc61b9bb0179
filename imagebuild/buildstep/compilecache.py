"""The compiler cache of compile stages, owned by imagebuild on the host (docs/build.md, "Compiler cache").

A BuildKit cache mount dies with the builder (``docker builder prune``), cannot be exported, and a
second node never has one. So imagebuild keeps each compile stage's ccache folder on the host,
under ``$XDG_CACHE_HOME/imagebuild/compiler-cache/<cache id>/`` (shared by every clone on this
host, like the stage store; ``$IMAGEBUILD_COMPILER_CACHE`` moves it), and:

- gives it to the stage as the named context ``imagebuild-ccache`` (bind-mounted read-only at
  ``/imagebuild/ccache``): ``imagebuild-ccache.sh`` (written next to ``imagebuild-src.sh``)
  configures ccache for a build container and, when the stage's cache mount is empty (a fresh
  builder, or the cache mounts were pruned), seeds the mount from it;
- takes it back after the stage is built: a second, small build (``--network none``) copies the
  cache mount out through ``--output type=local``. When the mount started as the host copy (its
  generation file, written at each take-back into both, is the host copy's), only what the compile
  changed comes out: files written after the compile began that the host copy does not hold under
  the same name and size (ccache touches the entries it hits, which does not make them new; its
  result files are named by the hash of their inputs and never change, and a manifest that gained an
  entry grew; a stale one could only cost a hit, never give a wrong object), and the list of every
  file, so entries ccache evicted go from the host copy too. (It needs GNU find, awk and tar in the
  stage; without them, the whole mount comes back.) They are applied file by file (rename) under a
  lock, and the generation is written last: a take-back killed half-way leaves a host copy whose
  generation matches no mount, so the next one copies the whole mount, replacing the host folder
  (rename), as the first one does. The stage's figures (``ccache --print-stats`` before and after
  the compile, written into the cache mount; the counters are not zeroed, which would rewrite every
  counter file of the cache) come back with it and go into the build record.

A stage opts in by binding ``imagebuild-ccache`` and mounting a cache at ``/root/.ccache``:

    RUN --mount=type=bind,from=imagebuild-src,target=/imagebuild/src \\
        --mount=type=bind,from=imagebuild-ccache,target=/imagebuild/ccache \\
        --mount=type=cache,id=<cache id>,target=/root/.ccache \\
        . /imagebuild/src/imagebuild-ccache.sh && ... compile through ccache ...

The cache is never part of a stage key (the key is what is compiled; a compiler cache does not
change it) and never in a layer (a cache mount and a bind mount leave nothing in the image).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from pathlib import Path

from imagebuild.core import fsutil
from imagebuild.core import run as run_mod
from imagebuild.core import state as state_mod

NAMED_CCACHE = "imagebuild-ccache"
SEED_MOUNT = "/imagebuild/ccache"
CCACHE_DIR = "/root/.ccache"
SCRIPT = "imagebuild-ccache.sh"
STATS_FILE = "imagebuild-stats.txt"  # in the cache folder: the counters after the last compile
STATS_BEFORE_FILE = "imagebuild-stats-before.txt"  # ... and before it (the figures are the difference)
GENERATION_FILE = "imagebuild-generation"  # the take-back that wrote it (host copy and mount alike)
START_FILE = "imagebuild-start"  # in the mount: written as the compile begins (what is newer, it wrote)
MODE_FILE = "imagebuild-export-mode"  # in the mount: delta (it started as the host copy) or full
ENV_DIR = "IMAGEBUILD_COMPILER_CACHE"
MAX_SIZE = "20G"  # ccache's max_size: the bound of one cache (ccache evicts the oldest beyond it)
# ccache configuration for a build container: sources are extracted in the same RUN (new ctime and
# mtime), __TIME__/__DATE__ do not change what vLLM compiles; the compiler is checked by content
# (a rebuilt base with the same nvcc keeps its hits); paths under the work folder are hashed
# relative to it.
CONFIG = {
    "CCACHE_DIR": CCACHE_DIR,
    "CCACHE_BASEDIR": "/imagebuild/work",
    "CCACHE_NOHASHDIR": "1",
    "CCACHE_SLOPPINESS": "include_file_ctime,include_file_mtime,time_macros,pch_defines",
    "CCACHE_COMPILERCHECK": "content",
    "CCACHE_MAXSIZE": MAX_SIZE,
}

_MOUNT_RE = re.compile(r"--mount=(\S+)")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def cache_root() -> Path:
    explicit = os.environ.get(ENV_DIR)
    return Path(explicit) if explicit else state_mod.cache_home() / "imagebuild" / "compiler-cache"


def host_dir(cache_id: str) -> Path:
    return cache_root() / cache_id


def cache_id_of(dockerfile_text: str) -> str | None:
    """The id of the ccache cache mount of a Dockerfile that binds ``imagebuild-ccache`` (else None)."""
    opts = [dict(kv.split("=", 1) for kv in m.group(1).split(",") if "=" in kv)
            for m in _MOUNT_RE.finditer(dockerfile_text)]
    if not any(o.get("type") == "bind" and o.get("from") == NAMED_CCACHE for o in opts):
        return None
    for o in opts:
        if o.get("type") == "cache" and o.get("target", "").rstrip("/") == CCACHE_DIR and _ID_RE.match(o.get("id", "")):
            return o["id"]
    return None


def script() -> bytes:
    """``imagebuild-ccache.sh``: sourced by a compile step (POSIX sh or bash)."""
    env = "".join(f"export {k}={v}\n" for k, v in CONFIG.items())
    return (
        "# generated by imagebuild (buildstep/compilecache.py): the compiler cache of this stage\n"
        + env
        + f'if [ -z "$(ls -A {CCACHE_DIR} 2>/dev/null)" ] && [ -n "$(ls -A {SEED_MOUNT} 2>/dev/null)" ]; then\n'
        f"  cp -a {SEED_MOUNT}/. {CCACHE_DIR}/ && rm -f {CCACHE_DIR}/{STATS_FILE} {CCACHE_DIR}/{STATS_BEFORE_FILE}\n"
        f'  echo "imagebuild-ccache: cache mount seeded from the host copy ($(du -sh {CCACHE_DIR} | cut -f1))"\n'
        "fi\n"
        # the take-back copies out only what this compile changed when the mount is the host copy
        # (a start file left behind: the last compile in this mount was never taken back, so it is not)
        f'if [ ! -e {CCACHE_DIR}/{START_FILE} ] && [ -s {SEED_MOUNT}/{GENERATION_FILE} ] && [ "$(cat {SEED_MOUNT}/{GENERATION_FILE})" = '
        f'"$(cat {CCACHE_DIR}/{GENERATION_FILE} 2>/dev/null)" ]; then echo delta > {CCACHE_DIR}/{MODE_FILE}; '
        f"else echo full > {CCACHE_DIR}/{MODE_FILE}; fi\n"
        f"mkdir -p {CCACHE_DIR} && : > {CCACHE_DIR}/{START_FILE}\n"
        "ccache --version | head -n 1\n"
        # the counters before the compile (its figures are the difference): zeroing them would rewrite
        # every counter file of the cache, and the take-back would have to bring them all
        f"ccache --print-stats > {CCACHE_DIR}/{STATS_BEFORE_FILE} 2>/dev/null || : > {CCACHE_DIR}/{STATS_BEFORE_FILE}\n"
        f"trap 'ccache --print-stats > {CCACHE_DIR}/{STATS_FILE} 2>/dev/null || true; "
        f"ccache --version | head -n 1 | sed \"s/^/version\\t/\" >> {CCACHE_DIR}/{STATS_FILE} || true' EXIT\n"
    ).encode()


# ccache --print-stats counters (ccache 4.x) that count a call it could not cache
UNCACHEABLE = ("autoconf_test", "bad_compiler_arguments", "bad_input_file", "bad_output_file",
               "called_for_link", "called_for_preprocessing", "compiler_check_failed", "compiler_produced_empty_output",
               "compiler_produced_no_output", "compiler_produced_stdout", "could_not_find_compiler",
               "could_not_use_modules", "could_not_use_precompiled_header", "disabled", "error_hashing_extra_file",
               "modified_input_file", "multiple_source_files", "no_input_file", "output_to_stdout",
               "preprocessor_error", "unsupported_code_directive", "unsupported_compiler_option",
               "unsupported_environment_variable", "unsupported_source_encoding", "unsupported_source_language",
               "compile_failed", "internal_error", "missing_cache_file", "recache")


def _counters(text: str) -> dict[str, str]:
    vals: dict[str, str] = {}
    for ln in text.splitlines():
        if "\t" in ln:
            k, v = ln.split("\t", 1)
            vals[k.strip()] = v.strip()
    return vals


def parse_stats(text: str, before: str = "") -> dict:
    """The record's figures from ``ccache --print-stats`` (tab-separated counters): those after the
    compile less those before it (``before``), but for the cache's size and file count."""
    vals, prior = _counters(text), _counters(before)

    def n(k: str) -> int:
        try:
            now = int(vals.get(k, 0))
            return now if k in ("cache_size_kibibyte", "files_in_cache") else max(0, now - int(prior.get(k, 0)))
        except ValueError:
            return 0

    direct, pre = n("direct_cache_hit"), n("preprocessed_cache_hit")
    hits, misses = direct + pre, n("cache_miss")
    unc = {k: n(k) for k in UNCACHEABLE if n(k)}
    total = hits + misses
    return {"tool": vals.get("version", "ccache"), "hits": hits, "direct_hits": direct, "preprocessed_hits": pre,
            "misses": misses, "uncacheable": sum(unc.values()), "uncacheable_by_reason": unc,
            "hit_rate": round(hits / total, 4) if total else None,
            "cache_bytes": n("cache_size_kibibyte") * 1024, "files": n("files_in_cache")}


def line(stats: dict | None) -> str:
    """One line for the live display and reports."""
    if not stats:
        return ""
    rate = "-" if stats.get("hit_rate") is None else f"{stats['hit_rate'] * 100:.1f}%"
    came = "; from the registry" if stats.get("seeded_from") == "registry" else ""
    return (f"ccache {rate} hit ({stats['hits']} hits, {stats['misses']} misses, {stats['uncacheable']} uncacheable; "
            f"{stats['cache_bytes'] / 2**20:.0f} MiB{came})")


EXPORT_DOCKERFILE = f"""\
FROM stage AS dump
ARG IMAGEBUILD_EXPORT
RUN --mount=type=cache,id={{cache_id}},target={CCACHE_DIR} \\
    --mount=type=bind,from={NAMED_CCACHE},target={SEED_MOUNT} \\
    set -eu; echo "export $IMAGEBUILD_EXPORT"; out=/imagebuild-ccache-out; mkdir -p "$out/files"; \\
    cd {CCACHE_DIR}; \\
    own="! -name {GENERATION_FILE} ! -name {START_FILE} ! -name {MODE_FILE}"; \\
    if [ "$(cat {MODE_FILE} 2>/dev/null)" = delta ] && [ -f {START_FILE} ] \\
        && find . -maxdepth 0 -printf '' 2>/dev/null && command -v awk >/dev/null && command -v tar >/dev/null; then \\
      find . -type f -newer {START_FILE} $own -printf '%s %p\\n' > /tmp/imagebuild-newer; \\
      (cd {SEED_MOUNT} && find . -type f -printf '%s %p\\n') > /tmp/imagebuild-seed; \\
      awk 'NR == FNR {{ seen[$0] = 1; next }} !($0 in seen) || $2 ~ /{STATS_FILE}$|{STATS_BEFORE_FILE}$/ \\
           {{ sub(/^[0-9]+ /, ""); print }}' /tmp/imagebuild-seed /tmp/imagebuild-newer > /tmp/imagebuild-changed; \\
      tar -cf - -T /tmp/imagebuild-changed | tar -xpf - -C "$out/files"; \\
      find . -type f $own > "$out/manifest"; \\
      echo delta > "$out/mode"; \\
    else \\
      cp -a . "$out/files/" && rm -f "$out/files/{GENERATION_FILE}" "$out/files/{START_FILE}" "$out/files/{MODE_FILE}"; \\
      echo full > "$out/mode"; \\
    fi; \\
    rm -f {START_FILE} {MODE_FILE}; echo "$IMAGEBUILD_EXPORT" > {GENERATION_FILE}; cp {GENERATION_FILE} "$out/generation"
FROM scratch
COPY --from=dump /imagebuild-ccache-out/ /
"""


def take_back(cache_id: str, *, stage_context: str, platform: str, tmp: Path, run_id: str, log_path: Path) -> dict | None:
    """Bring the stage's cache mount ``cache_id`` out of BuildKit into the host folder (what changed, or
    all of it: the module's docstring); returns the figures of the compile that just ran (None when it
    wrote none)."""
    dest = host_dir(cache_id)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = tmp / "ccache-export"
    work.mkdir(parents=True, exist_ok=True)
    (work / "Dockerfile").write_text(EXPORT_DOCKERFILE.replace("{cache_id}", cache_id))
    empty = work / "empty"
    empty.mkdir(exist_ok=True)
    out = dest.parent / f".{cache_id}.tmp-{os.getpid()}"
    shutil.rmtree(out, ignore_errors=True)
    generation = f"{run_id}-{secrets.token_hex(6)}"
    argv = ["docker", "buildx", "build", "--progress=plain", "--provenance=false", "--sbom=false",
            "--platform", platform, "--network", "none", "--file", str(work / "Dockerfile"),
            "--build-context", f"stage={stage_context}",
            "--build-context", f"{NAMED_CCACHE}={dest if dest.is_dir() else empty}",
            "--build-arg", f"IMAGEBUILD_EXPORT={generation}",
            "--output", f"type=local,dest={out}", str(work)]
    t0 = time.monotonic()
    proc = run_mod.run(argv, check=False, timeout=3600)
    with open(log_path, "ab") as f:
        f.write(b"\n# imagebuild: compiler cache taken back to the host\n" + (proc.stdout or b""))
    try:
        if proc.returncode != 0 or not (out / "generation").is_file():
            return None
        mode = (out / "mode").read_text().strip() if (out / "mode").is_file() else "full"
        with fsutil.held(dest.parent / f".{cache_id}.lock"):
            if mode == "delta" and dest.is_dir() and (out / "manifest").is_file():
                copied = _apply_delta(out, dest)
            else:
                mode, copied = "full", _replace(out, dest)
            _write_generation(dest, (out / "generation").read_text().strip())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    stats_file = dest / STATS_FILE
    if not stats_file.is_file():
        return None
    before = dest / STATS_BEFORE_FILE
    before_text = before.read_text(errors="replace") if before.is_file() else ""
    return {**parse_stats(stats_file.read_text(errors="replace"), before_text),
            "take_back_s": round(time.monotonic() - t0, 2),
            "take_back": mode, "take_back_files": copied}


def _files_under(top: Path) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(top):
        rel = os.path.relpath(dirpath, top)
        out.extend(f if rel == "." else f"{rel}/{f}" for f in files)
    return out


def _replace(out: Path, dest: Path) -> int:
    """The whole mount (``out/files``) becomes the host copy, in one rename."""
    files = out / "files"
    files.mkdir(exist_ok=True)
    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
    if dest.exists():
        dest.rename(old)
    files.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return len(_files_under(dest))


def _apply_delta(out: Path, dest: Path) -> int:
    """What the compile changed (``out/files``) into the host copy, file by file (rename); the host copy's
    files the mount no longer holds (``out/manifest``: ccache evicted them) removed."""
    changed = _files_under(out / "files")
    for rel in changed:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(out / "files" / rel, target)
    keep = {ln[2:] if ln.startswith("./") else ln
            for ln in (out / "manifest").read_text(errors="surrogateescape").splitlines() if ln}
    for rel in _files_under(dest):
        if rel not in keep and rel != GENERATION_FILE:
            (dest / rel).unlink(missing_ok=True)
    return len(changed)


def _write_generation(dest: Path, generation: str) -> None:
    tmp = dest / f".{GENERATION_FILE}.tmp-{os.getpid()}"
    tmp.write_text(generation + "\n")
    os.replace(tmp, dest / GENERATION_FILE)


def usage() -> list[dict]:
    """Every compiler cache on this host, for ``imagebuild df``."""
    root = cache_root()
    if not root.is_dir():
        return []
    return [{"id": d.name, "path": str(d), "bytes": _tree_bytes(d)}
            for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")]


def _tree_bytes(top: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(top):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def leftovers() -> list[Path]:
    """Temporary folders of a take-back that was killed (for ``imagebuild gc``)."""
    root = cache_root()
    out = []
    for p in sorted(root.glob(".*")) if root.is_dir() else ():
        m = re.search(r"\.(?:tmp|old)-(\d+)$", p.name)
        if p.is_dir() and m and not _alive(int(m.group(1))):
            out.append(p)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def give(dockerfile: Path, src_dir: Path, named: dict, empty: Path) -> str | None:
    """For a stage whose Dockerfile opts in: write ``imagebuild-ccache.sh`` into its source context and
    add the named context ``imagebuild-ccache`` (the host copy, or an empty folder). Returns the
    cache id (None: the stage does not use the compiler cache)."""
    try:
        cache_id = cache_id_of(dockerfile.read_text(errors="replace"))
    except OSError:
        return None
    if cache_id is None:
        return None
    (src_dir / SCRIPT).write_bytes(script())
    d = host_dir(cache_id)
    named[NAMED_CCACHE] = str(d if d.is_dir() else empty)
    return cache_id
