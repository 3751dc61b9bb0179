"""What changed between two built images: pins, patches, packages and layers.

``inventory(ref)`` reads what an image carries about itself, without starting anything in it
when it can:

- ``/opt/imagebuild/lock.json`` (the pins: each git source's commit and PR heads, each base image's
  digest), ``/opt/imagebuild/build.json`` (build id, stage keys, the build args that reached each
  stage, every patch's outcome and the sha256 of its script), both copied out of a created, never started container (``docker cp``);
- the package lists: ``/opt/imagebuild/pip-freeze.txt`` and ``/opt/imagebuild/dpkg.txt`` when a
  stage baked them (the example's runner does); otherwise dpkg's own database
  (``/var/lib/dpkg/status``, copied out the same way) and the installed Python distributions,
  listed by the image's ``python3`` in a throwaway container (``--network none``, removed after);
- the layers: diff ids (``RootFS.Layers``) with their sizes (``docker history``).

An inventory depends only on the image's content, so it is cached by identity under
``<state>/inventory/<identity-hex>.json`` (written atomically): the nightly's diff against the
previous ``:local`` costs nothing the second time.

``diff(a, b)`` compares two inventories; ``render(d)`` is the Markdown the run report and
``imagebuild diff`` print.
"""

from __future__ import annotations

import io
import json
import logging
import re
import secrets
import tarfile
from pathlib import Path

from imagebuild.core import context as context_mod
from imagebuild.core import fsutil
from imagebuild.core import identity as identity_mod
from imagebuild.core import run as run_mod
from imagebuild.core.fsutil import atomic_write_json
from imagebuild.definition import reader as defn_mod

log = logging.getLogger("imagebuild")

SCHEMA = "imagebuild.image-diff"
VERSION = 1
INVENTORY_VERSION = 2
META = "/opt/imagebuild"
DPKG_STATUS = "/var/lib/dpkg/status"
# Lists the installed Python distributions without pip (which an image may lack): name==version.
PY_LIST = ("import importlib.metadata as m,json;"
           "print(json.dumps(sorted({(d.metadata['Name'] or '?').lower()+'=='+(d.version or '?') "
           "for d in m.distributions()})))")


# --------------------------------------------------------------------------------------------- reading


def _cp_out(container: str, path: str) -> dict[str, bytes]:
    """Files under ``path`` in a (created, not started) container: {name relative to path's
    parent: bytes}. Empty when the path does not exist."""
    proc = run_mod.run(["docker", "cp", f"{container}:{path}", "-"], check=False, timeout=120)
    if proc.returncode != 0:
        return {}
    out: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(proc.stdout), mode="r:") as tf:
            for m in tf.getmembers():
                if m.isfile():
                    f = tf.extractfile(m)
                    if f is not None:
                        out[m.name] = f.read()
    except tarfile.TarError:
        return {}
    return out


def _json_or_none(data: bytes | None) -> dict | None:
    if data is None:
        return None
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def parse_dpkg_status(text: str) -> dict[str, str]:
    """{package: version} of the installed packages in a dpkg status file."""
    out: dict[str, str] = {}
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line[:1] in (" ", "\t") or ":" not in line:
                continue
            k, _, v = line.partition(":")
            fields[k.strip()] = v.strip()
        if fields.get("Package") and "installed" in fields.get("Status", "").split():
            out[fields["Package"]] = fields.get("Version", "?")
    return out


def parse_dpkg_list(text: str) -> dict[str, str]:
    """``dpkg-query -W`` output (``name<TAB>version``) as {name: version}."""
    out = {}
    for line in text.splitlines():
        parts = line.split("\t") if "\t" in line else line.split(None, 1)
        if len(parts) == 2 and parts[0].strip():
            out[parts[0].strip().split(":", 1)[0]] = parts[1].strip()  # libc6:amd64 -> libc6, as dpkg's status
    return out


def parse_freeze(text: str) -> dict[str, str]:
    """``pip freeze`` lines (``name==version``, ``name @ url``) as {lower-case name: version}."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "==" in line:
            n, _, v = line.partition("==")
        elif " @ " in line:
            n, _, v = line.partition(" @ ")
        else:
            n, v = line, "?"
        out[n.strip().lower().replace("_", "-")] = v.strip()
    return out


def _python_distributions(ref: str) -> dict[str, str] | None:
    for py in ("python3", "python"):
        proc = run_mod.run(["docker", "run", "--rm", "--network", "none", "--pull", "never", "--entrypoint", py,
                            ref, "-c", PY_LIST], check=False, timeout=120)
        if proc.returncode == 0:
            try:
                return parse_freeze("\n".join(json.loads(proc.stdout.decode().strip().splitlines()[-1])))
            except (ValueError, IndexError):
                return None
    return None


# history entries that never make a layer (metadata only); WORKDIR sometimes does
_META_ONLY = ("ENV", "ARG", "LABEL", "CMD", "ENTRYPOINT", "EXPOSE", "USER", "VOLUME", "STOPSIGNAL", "HEALTHCHECK",
              "SHELL", "MAINTAINER", "ONBUILD")


def _instruction(created_by: str) -> str:
    text = created_by.strip()
    if text.startswith("/bin/sh -c #(nop)"):
        text = text[len("/bin/sh -c #(nop)"):].strip()
    return text.split(None, 1)[0].upper() if text else ""


def layer_sizes_from_history(rows: list[tuple[int, str]], n_layers: int) -> list[int | None]:
    """Each layer's size (base first) from ``docker history`` rows (size, created by), oldest
    first: the rows whose instruction makes a layer. Unknown (None) when no reading of the rows
    gives exactly ``n_layers``."""
    def pick(include_workdir: bool) -> list[int]:
        return [size for size, by in rows if _instruction(by) not in _META_ONLY
                and (include_workdir or _instruction(by) != "WORKDIR")]

    for sizes in (pick(False), pick(True), [s for s, _ in rows if s > 0]):
        if len(sizes) == n_layers:
            return sizes
    return [None] * n_layers


def _layer_sizes(ref: str, layers: list[str]) -> list[int | None]:
    proc = run_mod.run(["docker", "history", "--no-trunc", "--human=false", "--format", "{{.Size}}\t{{.CreatedBy}}",
                        ref], check=False, timeout=60)
    if proc.returncode != 0:
        return [None] * len(layers)
    rows = []
    for ln in reversed(proc.stdout.decode("utf-8", "replace").splitlines()):
        size, _, by = ln.partition("\t")
        try:
            rows.append((int(size), by))
        except ValueError:
            return [None] * len(layers)
    return layer_sizes_from_history(rows, len(layers))


def inventory(ref: str, ctx: context_mod.Context | Path | None = None, *, use_cache: bool = True) -> dict:
    """What ``ref`` holds (see the module doc), kept in the project's state folder when there is a
    project (``ctx``). Raises OperationFailed when the image is missing."""
    ctx = context_mod.maybe(ctx)
    hint = "docker image ls; `imagebuild log` shows which builds exist"
    repo = ref.split("@", 1)[0].rsplit(":", 1)[0]
    if ctx is not None and defn_mod.NAME_RE.match(repo) and not (ctx.root / defn_mod.IMAGES_DIR / repo).is_dir():
        close = defn_mod.close_image(ctx.root, repo)  # a mistyped image of this project: as every command says it
        if close:
            hint = f"did you mean {close + ref[len(repo):]!r}? ({hint})"
    data = identity_mod.inspect_data(ref, hint=hint)
    ident = identity_mod.from_inspect(data)
    cache = None
    if ctx is not None:
        cache = ctx.state / "inventory" / f"{ident.digest.split(':', 1)[1]}.json"
        if use_cache:
            try:
                doc = json.loads(fsutil.read_text(cache))
                if doc.get("inventory_version") == INVENTORY_VERSION and doc.get("identity") == ident.digest:
                    return {**doc, "ref": ref, "image_id": data.get("Id")}
            except (OSError, ValueError):
                pass
    labels = (data.get("Config") or {}).get("Labels") or {}
    name = f"imagebuild-inventory-{secrets.token_hex(4)}"
    run_mod.run(["docker", "create", "--pull", "never", "--network", "none", "--name", name, "--entrypoint", "true",
                 ref], timeout=120, hint="is the Docker engine healthy? (imagebuild doctor)")
    try:
        meta = {k.split("/", 1)[-1]: v for k, v in _cp_out(name, META).items()}
        dpkg_status = _cp_out(name, DPKG_STATUS).get("status")
    finally:
        run_mod.run(["docker", "rm", "-f", name], check=False, timeout=60)
    pip_source = dpkg_source = None
    pip = dpkg = None
    if "pip-freeze.txt" in meta:
        pip, pip_source = parse_freeze(meta["pip-freeze.txt"].decode("utf-8", "replace")), f"{META}/pip-freeze.txt"
    else:
        pip = _python_distributions(ref)
        pip_source = "python3 -c importlib.metadata (run in the image, --network none)" if pip is not None else None
    if "dpkg.txt" in meta:
        dpkg, dpkg_source = parse_dpkg_list(meta["dpkg.txt"].decode("utf-8", "replace")), f"{META}/dpkg.txt"
    elif dpkg_status is not None:
        dpkg, dpkg_source = parse_dpkg_status(dpkg_status.decode("utf-8", "replace")), DPKG_STATUS
    layers = list(ident.layers)
    sizes = _layer_sizes(ref, layers)
    build = _json_or_none(meta.get("build.json"))
    doc = {
        "inventory_version": INVENTORY_VERSION, "ref": ref, "identity": ident.digest, "image_id": data.get("Id"),
        "size": int(data.get("Size") or 0),
        "build_id": labels.get("io.imagebuild.build-id") or (build or {}).get("build_id"),
        "version": labels.get("org.opencontainers.image.version"),
        "revision": labels.get("org.opencontainers.image.revision"),
        "lock": _json_or_none(meta.get("lock.json")),
        "build": build,
        "pip": pip, "pip_source": pip_source, "dpkg": dpkg, "dpkg_source": dpkg_source,
        "layers": [{"diff_id": d, "size": s} for d, s in zip(layers, sizes, strict=True)],
    }
    if cache is not None:
        try:
            atomic_write_json(cache, doc)
        except OSError as exc:  # a cache: never fail the diff for it
            log.debug("inventory cache not written (%s)", exc)
    return doc


# --------------------------------------------------------------------------------------------- comparing


def _pins(inv: dict) -> dict[str, str]:
    """Every pin an image carries, as {what: value}: each source's commit, base and PR heads, and
    each base image's digest (from its lock)."""
    out: dict[str, str] = {}
    lock = inv.get("lock") or {}
    for name, s in sorted((lock.get("sources") or {}).items()):
        if not isinstance(s, dict):
            continue
        if s.get("ref"):
            out[f"{name} ref"] = str(s["ref"])
        if s.get("follows"):  # NAME_REF=<branch or tag>@<sha>: following another name is a moved pin too
            out[f"{name} follows"] = str(s["follows"])
        for pr in s.get("prs") or []:
            if isinstance(pr, dict) and pr.get("number") is not None:
                out[f"{name} PR {pr['number']}"] = str(pr.get("sha") or "?")
            elif isinstance(pr, list | tuple) and len(pr) == 2:
                out[f"{name} PR {pr[0]}"] = str(pr[1])
        if s.get("commit"):
            out[f"{name} commit"] = str(s["commit"])
    for key, im in sorted((lock.get("images") or {}).items()):
        if isinstance(im, dict):
            out[f"{key} image"] = str(im.get("ref") or im.get("digest"))
    return out


def _build_args(inv: dict) -> dict[str, str] | None:
    """The build args that reached each stage, as {"STAGE KEY": value} (build.json's ``stages[].args``);
    None for an image built before they were recorded."""
    stages = (inv.get("build") or {}).get("stages") or []
    if not any(isinstance(s, dict) and isinstance(s.get("args"), dict) for s in stages):
        return None
    return {f"{s.get('name')} {k}": str(v) for s in stages if isinstance(s, dict)
            for k, v in sorted((s.get("args") or {}).items())}


def _patches(inv: dict) -> dict[str, str]:
    out = {}
    for name, p in sorted(((inv.get("build") or {}).get("patches") or {}).items()):
        if isinstance(p, dict):
            out[name] = f"{p.get('outcome') or '?'} sha256:{str(p.get('sha256') or '?').removeprefix('sha256:')[:12]}"
    return out


def _compare(a: dict[str, str] | None, b: dict[str, str] | None) -> dict | None:
    if a is None or b is None:
        return None
    return {"added": [{"name": k, "to": b[k]} for k in sorted(set(b) - set(a))],
            "removed": [{"name": k, "from": a[k]} for k in sorted(set(a) - set(b))],
            "changed": [{"name": k, "from": a[k], "to": b[k]} for k in sorted(set(a) & set(b)) if a[k] != b[k]],
            "unchanged": sum(1 for k in set(a) & set(b) if a[k] == b[k])}


def _side(inv: dict) -> dict:
    return {"ref": inv.get("ref"), "identity": inv.get("identity"), "build_id": inv.get("build_id"),
            "size": inv.get("size")}


def diff(a: dict, b: dict) -> dict:
    """What changed from image ``a`` to image ``b`` (two inventories)."""
    la = [x["diff_id"] for x in a.get("layers") or []]
    lb = [x["diff_id"] for x in b.get("layers") or []]
    size_b = {x["diff_id"]: x["size"] for x in b.get("layers") or []}
    size_a = {x["diff_id"]: x["size"] for x in a.get("layers") or []}
    shared = [d for d in lb if d in set(la)]
    added = [{"diff_id": d, "size": size_b.get(d)} for d in lb if d not in set(la)]
    removed = [{"diff_id": d, "size": size_a.get(d)} for d in la if d not in set(lb)]
    known = [x["size"] for x in added]
    return {
        "schema": SCHEMA, "version": VERSION,
        "from": _side(a), "to": _side(b),
        "same_image": a.get("identity") == b.get("identity"),
        "pins": _compare(_pins(a), _pins(b)),
        "build_args": _compare(_build_args(a), _build_args(b)),
        "patches": _compare(_patches(a), _patches(b)),
        "pip": _compare(a.get("pip"), b.get("pip")),
        "dpkg": _compare(a.get("dpkg"), b.get("dpkg")),
        "package_sources": {"pip": [a.get("pip_source"), b.get("pip_source")],
                            "dpkg": [a.get("dpkg_source"), b.get("dpkg_source")]},
        "layers": {"from": len(la), "to": len(lb), "shared": len(shared), "added": added, "removed": removed,
                   "added_bytes": sum(s for s in known if s is not None) if all(s is not None for s in known)
                   else None},
    }


# --------------------------------------------------------------------------------------------- output


def human(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _section(title: str, cmp: dict | None, limit: int, missing: str) -> list[str]:
    if cmp is None:
        return [f"- **{title}**: {missing}"]
    n = len(cmp["added"]) + len(cmp["removed"]) + len(cmp["changed"])
    if n == 0:
        return [f"- **{title}**: unchanged ({cmp['unchanged']})"]
    lines = [f"- **{title}**: {len(cmp['changed'])} changed, {len(cmp['added'])} added, {len(cmp['removed'])} "
             f"removed, {cmp['unchanged']} unchanged"]
    rows = ([f"  - `{c['name']}`: {_short(c['from'])} -> {_short(c['to'])}" for c in cmp["changed"]]
            + [f"  - `{c['name']}`: added ({_short(c['to'])})" for c in cmp["added"]]
            + [f"  - `{c['name']}`: removed (was {_short(c['from'])})" for c in cmp["removed"]])
    lines += rows[:limit]
    if len(rows) > limit:
        lines.append(f"  - ... and {len(rows) - limit} more (imagebuild diff shows all)")
    return lines


def _short(v: str) -> str:
    # a 40/64-hex sha (alone or after '@' or 'sha256:') shortened to 12
    return re.sub(r"\b([0-9a-f]{12})[0-9a-f]{28,52}\b", r"\1", str(v))


def render(d: dict, *, limit: int = 20) -> str:
    """The diff as Markdown (a list), as the run report and ``imagebuild diff`` show it."""
    a, b = d["from"], d["to"]
    lines = [f"- from `{a['ref']}` (build {a['build_id'] or '-'}, identity {str(a['identity'])[:19]}) "
             f"to `{b['ref']}` (build {b['build_id'] or '-'}, identity {str(b['identity'])[:19]})"]
    if d["same_image"]:
        lines.append("- **same image**: identical identity, nothing changed")
        return "\n".join(lines)
    lines += _section("pins", d["pins"], limit, "no lock in one of the images")
    lines += _section("build args", d.get("build_args"), limit,
                      "not recorded in one of the images (built before build args were recorded)")
    lines += _section("patches", d["patches"], limit, "no build record in one of the images")
    lines += _section("pip", d["pip"], limit, "no Python distributions listed in one of the images")
    lines += _section("dpkg", d["dpkg"], limit, "no dpkg database in one of the images")
    ly = d["layers"]
    lines.append(f"- **layers**: {ly['shared']} of {ly['to']} shared with the previous image, {len(ly['added'])} new "
                 f"({human(ly['added_bytes'])}), {len(ly['removed'])} gone; size {human(a['size'])} -> "
                 f"{human(b['size'])}")
    for x in ly["added"][:limit]:
        lines.append(f"  - new `{x['diff_id'][:19]}` {human(x['size'])}")
    return "\n".join(lines)
