"""The check kinds of a gate spec, run against a container through a testinfra host.

Each ``check_<kind>(ctx, check)`` returns a one-line detail when the check passes and raises
``CheckFailed`` with a one-line detail (what was found, what was expected) when it does not.
Python-based checks run the image's own interpreter (``python:`` in the spec) with a small
snippet passed as an argument; image metadata checks read ``docker image inspect`` data and
need no container. Every command and its output goes to the gate log (``ctx.log``).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from imagebuild.definition.gatespec import Check
from imagebuild.gate import cuda_targets


class CheckFailed(AssertionError):
    """A check ran and its condition does not hold."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


@dataclass
class Context:
    host: object  # testinfra.host.Host for the gate container
    python: str
    inspect: dict  # docker image inspect object of the image
    log: Callable[[str], None]


@dataclass
class Out:
    rc: int
    stdout: str
    stderr: str


def _run(ctx: Context, check: Check, command: str, *args: str) -> Out:
    res = ctx.host.run(command, *args)
    out = Out(res.rc, res.stdout_bytes.decode("utf-8", "replace"), res.stderr_bytes.decode("utf-8", "replace"))
    shown = command % tuple(shlex.quote(a) for a in args) if args else command
    ctx.log(f"[{check.id}] $ {shown}\n[{check.id}] exit {out.rc}\n" + _indent(check.id, "stdout", out.stdout)
            + _indent(check.id, "stderr", out.stderr))
    return out


def _indent(cid: str, name: str, text: str) -> str:
    if not text:
        return ""
    return "".join(f"[{cid}] {name}| {line}\n" for line in text.rstrip("\n").splitlines())


def _last(text: str, n: int = 200) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    s = lines[-1] if lines else ""
    return s if len(s) <= n else s[: n - 3] + "..."


def _python(ctx: Context, check: Check, snippet: str, *args: str) -> Out:
    out = _run(ctx, check, f"{shlex.quote(ctx.python)} -c %s" + " %s" * len(args), snippet, *args)
    if out.rc == 127 or "not found" in out.stderr and out.rc in (126, 127):
        raise CheckFailed(f"{ctx.python}: not found in the image (set `python:` in the gate spec)")
    return out


# ---------------------------------------------------------------------------------------------


_IMPORT = "import importlib, sys\nm = importlib.import_module(sys.argv[1])\nprint(getattr(m, '__file__', None))"


def check_import(ctx: Context, check: Check) -> str:
    mod = check.params["module"]
    out = _python(ctx, check, _IMPORT, mod)
    if out.rc != 0:
        raise CheckFailed(f"import {mod} failed: {_last(out.stderr) or f'exit {out.rc}'}")
    where = _last(out.stdout)
    return f"import {mod} ok" + (f" ({where})" if where and where != "None" else "")


_VERSION = "import importlib.metadata as m, sys\nprint(m.version(sys.argv[1]))"


def check_version(ctx: Context, check: Check) -> str:
    dist, spec = check.params["distribution"], check.params["specifier"]
    out = _python(ctx, check, _VERSION, dist)
    if out.rc != 0:
        if "PackageNotFoundError" in out.stderr:
            raise CheckFailed(f"distribution {dist} is not installed (wanted {spec})")
        raise CheckFailed(f"reading the version of {dist} failed: {_last(out.stderr)}")
    found = out.stdout.strip()
    try:
        version = Version(found)
    except InvalidVersion:
        raise CheckFailed(f"{dist} has version {found!r}, which is not a PEP 440 version (wanted {spec})") from None
    if not SpecifierSet(spec).contains(version, prereleases=True):
        raise CheckFailed(f"{dist} {found} does not satisfy {spec}")
    return f"{dist} {found} satisfies {spec}"


def check_command(ctx: Context, check: Check) -> str:
    p = check.params
    run = p["run"]
    command = run if isinstance(run, str) else shlex.join(run)
    out = _run(ctx, check, command)
    problems = []
    if out.rc != p["exit"]:
        problems.append(f"exit {out.rc}, expected {p['exit']}" + (f": {_last(out.stderr)}" if out.stderr.strip()
                                                                   else ""))
    for stream in ("stdout", "stderr"):
        text = getattr(out, stream)
        for pat in p.get(stream) or []:
            if not re.search(pat, text, re.MULTILINE):
                problems.append(f"{stream} does not match /{pat}/" + (f" (last line: {_last(text, 80)!r})"
                                                                      if text.strip() else f" ({stream} empty)"))
        for pat in p.get(f"{stream}_not") or []:
            hit = re.search(pat, text, re.MULTILINE)
            if hit:
                problems.append(f"{stream} matches /{pat}/ ({hit.group(0)[:80]!r})")
    if problems:
        raise CheckFailed(f"`{_short(command)}`: " + "; ".join(problems))
    return f"`{_short(command)}` exit {out.rc}" + (f": {_last(out.stdout, 80)}" if out.stdout.strip() else "")


def _short(command: str, n: int = 60) -> str:
    return command if len(command) <= n else command[: n - 3] + "..."


_FILE_SH = """if [ -e "$1" ] || [ -L "$1" ]; then echo exists; else echo missing; exit 0; fi
if [ -f "$1" ]; then echo file; else echo other; exit 0; fi
if [ "$2" = 1 ]; then sha256sum "$1" || exit 1; echo ---; cat "$1" || exit 1; fi"""


def check_file(ctx: Context, check: Check) -> str:
    p = check.params
    path = p["path"]
    need = "1" if any(p.get(k) for k in ("contains", "matches", "sha256")) else "0"
    # plain shell, so that images without Python (busybox) can be gated too
    out = _run(ctx, check, "sh -c %s sh %s %s", _FILE_SH, path, need)
    if out.rc != 0:
        raise CheckFailed(f"reading {path} failed: {_last(out.stderr) or f'exit {out.rc}'}")
    first, _, rest = out.stdout.partition("\n")
    exists = first.strip() == "exists"
    if not p["exists"]:
        if exists:
            raise CheckFailed(f"{path} exists, expected it to be absent")
        return f"{path} is absent"
    if not exists:
        raise CheckFailed(f"{path} does not exist")
    if need == "0":
        return f"{path} exists"
    parts = rest.split("\n", 3)
    if parts[0] != "file":
        raise CheckFailed(f"{path} is not a regular file")
    if len(parts) < 3 or parts[2] != "---":
        raise CheckFailed(f"reading {path} failed: unexpected output {out.stdout[:80]!r}")
    digest = parts[1].split()[0] if parts[1].split() else ""
    text = parts[3] if len(parts) > 3 else ""
    found = []
    if p.get("sha256"):
        if digest != p["sha256"]:
            raise CheckFailed(f"{path} has sha256 {digest}, expected {p['sha256']}")
        found.append("sha256 ok")
    for needle in p.get("contains") or []:
        if needle not in text:
            raise CheckFailed(f"{path} does not contain {needle!r}")
        found.append(f"contains {needle!r}")
    for pat in p.get("matches") or []:
        hit = re.search(pat, text, re.MULTILINE)
        if not hit:
            raise CheckFailed(f"{path} does not match /{pat}/")
        found.append(f"matches {hit.group(0)[:60]!r}")
    return f"{path}: " + ", ".join(found)


def check_metadata(ctx: Context, check: Check) -> str:
    p = check.params
    data = ctx.inspect
    cfg = data.get("Config") or {}
    problems, ok = [], []

    def cmp(name, found, want):
        if found != want:
            problems.append(f"{name} is {found!r}, expected {want!r}")
        else:
            ok.append(name)

    if "architecture" in p:
        cmp("architecture", data.get("Architecture"), p["architecture"])
    if "os" in p:
        cmp("os", data.get("Os"), p["os"])
    if "user" in p:
        cmp("user", cfg.get("User") or "", p["user"])
    if "workdir" in p:
        cmp("workdir", cfg.get("WorkingDir") or "", p["workdir"])
    for key, field in (("entrypoint", "Entrypoint"), ("cmd", "Cmd")):
        if key in p:
            cmp(key, cfg.get(field) or None, p[key])
    labels = cfg.get("Labels") or {}
    for k, want in (p.get("labels") or {}).items():
        cmp(f"label {k}", labels.get(k), want)
    env = dict(e.split("=", 1) if "=" in e else (e, "") for e in cfg.get("Env") or [])
    for k, want in (p.get("env") or {}).items():
        cmp(f"env {k}", env.get(k), want)
    ctx.log(f"[{check.id}] image metadata: " + json.dumps({"Architecture": data.get("Architecture"),
                                                          "Os": data.get("Os"), "Config": cfg}, sort_keys=True))
    if problems:
        raise CheckFailed("; ".join(problems))
    return "metadata ok: " + ", ".join(ok)


_EXPR = """import importlib, sys
ns = {}
for name in sys.argv[2:]:
    importlib.import_module(name)
    top = name.split(".")[0]
    ns[top] = importlib.import_module(top)
value = eval(sys.argv[1], ns)
print(repr(value)[:300])
sys.exit(0 if value else 3)"""


def check_expression(ctx: Context, check: Check) -> str:
    p = check.params
    out = _python(ctx, check, _EXPR, p["expr"], *p["imports"])
    if out.rc == 3:
        raise CheckFailed(f"{p['expr']} is false ({_last(out.stdout, 80)})")
    if out.rc != 0:
        raise CheckFailed(f"{p['expr']} raised: {_last(out.stderr)}")
    return f"{p['expr']} -> {_last(out.stdout, 80)}"


# Reads e_ident and e_machine of each matching regular file; prints [[path, machine|None], ...].
_ELF = """import fnmatch, json, os, sys
root, globs, res = sys.argv[1], sys.argv[2].split("\\n"), []
walk = [(os.path.dirname(root), [], [os.path.basename(root)])] if os.path.isfile(root) else os.walk(root)
for d, dirs, files in walk:
    dirs.sort()
    for n in sorted(files):
        p = os.path.join(d, n)
        if not any(fnmatch.fnmatch(n, g) for g in globs) or os.path.islink(p) or not os.path.isfile(p):
            continue
        with open(p, "rb") as f:
            h = f.read(20)
        if len(h) < 20 or h[:4] != b"\\x7fELF":
            res.append([p, None])
            continue
        res.append([p, int.from_bytes(h[18:20], "little" if h[5] == 1 else "big")])
if not os.path.exists(root):
    sys.exit("no such path: " + root)
print(json.dumps(res))"""


def check_elf(ctx: Context, check: Check) -> str:
    p = check.params
    out = _python(ctx, check, _ELF, p["path"], "\n".join(p["glob"]))
    if out.rc != 0:
        raise CheckFailed(f"scanning {p['path']} failed: {_last(out.stderr) or f'exit {out.rc}'}")
    files = json.loads(out.stdout.strip().splitlines()[-1])
    want, name = p["machine"], p.get("machine_name", str(p["machine"]))
    if len(files) < p["min_files"]:
        raise CheckFailed(f"found {len(files)} file(s) matching {', '.join(p['glob'])} under {p['path']}, "
                          f"expected at least {p['min_files']}")
    not_elf = [f for f, m in files if m is None]
    wrong = [(f, m) for f, m in files if m is not None and m != want]
    if not_elf or wrong:
        parts = []
        if wrong:
            parts.append(f"{len(wrong)} with another machine, e.g. {wrong[0][0]} (e_machine {wrong[0][1]})")
        if not_elf:
            parts.append(f"{len(not_elf)} not ELF, e.g. {not_elf[0]}")
        raise CheckFailed(f"{len(files)} file(s) under {p['path']}, expected e_machine {want} ({name}): "
                          + "; ".join(parts))
    return f"{len(files)} ELF file(s) under {p['path']}, all e_machine {want} ({name})"


def check_pip_check(ctx: Context, check: Check) -> str:
    allow = check.params["allow"]
    out = _run(ctx, check, f"{shlex.quote(ctx.python)} -m pip check")
    if "No module named pip" in out.stderr:
        raise CheckFailed(f"pip is not installed for {ctx.python}")
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    if out.rc == 0 and (not lines or lines[-1].startswith("No broken requirements")):
        return "no broken requirements"
    if out.rc not in (0, 1):
        raise CheckFailed(f"pip check failed to run (exit {out.rc}): {_last(out.stderr)}")
    problems = [ln for ln in lines if not ln.startswith("No broken requirements")]
    left = [ln for ln in problems if not any(re.search(a, ln) for a in allow)]
    if left:
        more = f" (+{len(left) - 1} more)" if len(left) > 1 else ""
        raise CheckFailed(f"pip check: {left[0]}{more}")
    return f"{len(problems)} pip check problem(s), all allowed"


# Lists the regular files under $1 whose names match the globs ($3...), after the cuobjdump to use
# ($2, or the one on PATH, or the CUDA toolkit's). Plain shell: the image needs no Python for this.
_CUDA_FIND = """root=$1; c=$2; shift 2
[ -e "$root" ] || { echo "no such path: $root" >&2; exit 2; }
if [ -z "$c" ]; then c=$(command -v cuobjdump) || c=/usr/local/cuda/bin/cuobjdump; fi
command -v "$c" >/dev/null 2>&1 || { echo "cuobjdump not found ($c)" >&2; exit 127; }
if ! err=$("$c" --version 2>&1 >/dev/null); then
  printf '%s\n%s\n%s\n' "$c" "$(printf '%s\n' "$err" | tail -n 1)" "$(ldd --version 2>/dev/null | head -n 1)" >&2
  exit 126
fi
command -v "$c"
n=$#; i=0
for g; do [ $i -gt 0 ] && set -- "$@" -o; set -- "$@" -name "$g"; i=$((i + 1)); done
shift $n
find "$root" -type f \\( "$@" \\) -print | LC_ALL=C sort"""

# Runs cuobjdump ($1, with option $2 when set) on each file ($3...), framing each listing.
_CUDA_LIST = """c=$1; opt=$2; shift 2
for f; do
  printf '\\n%s%s\\n' "$F" "$f"
  if [ -n "$opt" ]; then "$c" "$opt" "$f" 2>&1; else "$c" "$f" 2>&1; fi
  printf '\\n%s%s\\n' "$R" "$?"
done"""

# The PTX pass: cuobjdump -ptx ($1) on each file ($3...), keeping only the lines that match the
# extended regex $2 (headers, arch, .version), framed per file with cuobjdump's own exit code.
_CUDA_PTX = """c=$1; keep=$2; shift 2
for f; do
  printf '\\n%s%s\\n' "$F" "$f"
  out=$("$c" -ptx "$f" 2>&1); rc=$?
  printf '%s\\n' "$out" | grep -E "$keep"
  printf '\\n%s%s\\n' "$R" "$rc"
done"""


_PACKAGE_DIR = """import importlib.util, os, sys
spec = importlib.util.find_spec(sys.argv[1])
if spec is None:
    sys.exit("no module named " + sys.argv[1])
locs = list(spec.submodule_search_locations or [])
print(locs[0] if locs else spec.origin)"""


def _package_dir(ctx: Context, check: Check, module: str) -> str:
    """Where ``module`` is installed in the image (found, not imported: find_spec of a top level)."""
    out = _python(ctx, check, _PACKAGE_DIR, module)
    if out.rc != 0:
        raise CheckFailed(f"cannot find module {module}: {_last(out.stderr) or f'exit {out.rc}'}")
    return _last(out.stdout)


def _cuobjdump_cannot_run(stderr: str) -> str:
    """The reason a cuobjdump that is there does not run: (its path, its error, the image's ``ldd --version``)."""
    tool, err, libc = ([*stderr.strip().splitlines(), "", "", ""])[:3]
    need = re.search(r"version .(GLIBC_[0-9.]+). not found", err)
    have = re.search(r"([0-9]+\.[0-9]+)\s*$", libc)
    if need:
        why = f"it needs {need.group(1)}" + (f", the image's glibc is {have.group(1)}" if have else "")
    else:
        why = err.strip()[-200:] or "it exits non-zero on --version"
    return (f"cuobjdump cannot run in the image ({tool}): {why}; use one built for the image's C library (the "
            "CUDA toolkit's own) with `cuobjdump:` in the gate spec")


def check_cuda_targets(ctx: Context, check: Check) -> str:
    p = dict(check.params)
    if p.get("module"):
        p["path"] = _package_dir(ctx, check, p["module"])
    out = _run(ctx, check, "sh -c %s sh %s %s" + " %s" * len(p["glob"]), _CUDA_FIND, p["path"],
               p.get("cuobjdump") or "", *p["glob"])
    if out.rc == 127:
        raise CheckFailed(f"{_last(out.stderr)} in the image (install nvidia-cuda-cuobjdump, or set "
                          f"`cuobjdump:` in the gate spec)")
    if out.rc == 126:  # there, but it does not run: a build for a newer C library than the image's, typically
        raise CheckFailed(_cuobjdump_cannot_run(out.stderr))
    if out.rc != 0:
        raise CheckFailed(f"scanning {p['path']} failed: {_last(out.stderr) or f'exit {out.rc}'}")
    lines = [ln for ln in out.stdout.splitlines() if ln]
    tool, files = lines[0], lines[1:]
    option = "--dump-resource-usage" if p["kernels"] else ""
    listing = []
    for i in range(0, len(files), 200):  # well under any ARG_MAX
        chunk = files[i:i + 200]
        env = f"F={shlex.quote(cuda_targets.FRAME)} R={shlex.quote(cuda_targets.RC)} "
        res = ctx.host.run(env + "sh -c %s sh %s %s" + " %s" * len(chunk), _CUDA_LIST, tool, option, *chunk)
        if res.rc != 0:
            raise CheckFailed(f"running {tool} failed (exit {res.rc}): {_last(res.stderr_bytes.decode('utf-8', 'replace'))}")
        listing.append(res.stdout_bytes.decode("utf-8", "replace"))
    scan = cuda_targets.parse_scan("\n".join(listing))
    if p.get("driver"):  # the PTX ISA version of every PTX, read from the PTX text itself
        with_ptx = sorted(f for f, fb in scan.cuda.items() if fb.ptx)
        for i in range(0, len(with_ptx), 200):
            chunk = with_ptx[i:i + 200]
            env = f"F={shlex.quote(cuda_targets.FRAME)} R={shlex.quote(cuda_targets.RC)} "
            res = ctx.host.run(env + "sh -c %s sh %s %s" + " %s" * len(chunk), _CUDA_PTX, tool,
                               cuda_targets.PTX_KEEP, *chunk)
            if res.rc != 0:
                raise CheckFailed(f"running {tool} -ptx failed (exit {res.rc}): "
                                  f"{_last(res.stderr_bytes.decode('utf-8', 'replace'))}")
            cuda_targets.add_ptx_versions(scan, res.stdout_bytes.decode("utf-8", "replace"))
    for f in sorted(scan.cuda):  # one line a file; a full listing of a vLLM wheel is megabytes
        fb = scan.cuda[f]
        isa = " ".join(f"{a}={v}" for a, v in sorted(fb.ptx_isa))
        ctx.log(f"[{check.id}] {f}: SASS {' '.join(sorted(fb.sass)) or '-'}; PTX {' '.join(sorted(fb.ptx)) or '-'}"
                + (f"; PTX ISA {isa}" if isa else "")
                + (f"; {len(fb.kernels)} kernels" if option else "") + "\n")
    for f, msg in sorted(scan.unreadable.items()):
        ctx.log(f"[{check.id}] {f}: unreadable: {msg}\n")
    ok, detail = cuda_targets.judge(scan, sass=p["sass"], ptx=p["ptx"], require=p["require"],
                                    kernels=p["kernels"], min_files=p["min_files"],
                                    tolerate=p.get("tolerate") or [], libraries=p.get("libraries") or [],
                                    root=p["path"], driver=p.get("driver"))
    if not ok:
        raise CheckFailed(f"{p['path']}: {detail}")
    return f"{p['path']}: {detail} (by {tool})"


# The git tree id of a folder, computed as git computes it (no git needed in the image): a blob is
# sha1("blob <size>\\0" + bytes), a tree sha1("tree <size>\\0" + entries), each entry "<mode> <name>\\0" +
# the 20-byte id, sorted by name with a folder's name compared as "<name>/". Modes: 100644, 100755 (the
# owner's execute bit), 120000 (a symlink: its target is the blob), 40000 (a folder). A folder with nothing
# left in it is no entry (git keeps no empty folders). Names matching an exclude glob ($2, one a line) are
# left out at every level. Prints {"tree", "files": [[mode, id, path]], "excluded": [paths]}.
_GIT_TREE = """import fnmatch, hashlib, json, os, stat, sys
root, globs = sys.argv[1], [g for g in sys.argv[2].split("\\n") if g]
files, excluded = [], []
def obj(kind, data):
    return hashlib.sha1(kind + b" " + str(len(data)).encode() + b"\\0" + data).digest()
def tree(d, rel):
    entries = []
    for n in os.listdir(d):
        p, r = os.path.join(d, n), (rel + "/" + n if rel else n)
        if any(fnmatch.fnmatchcase(n, g) for g in globs):
            excluded.append(r)
            continue
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            mode, oid = b"120000", obj(b"blob", os.fsencode(os.readlink(p)))
        elif stat.S_ISDIR(st.st_mode):
            oid = tree(p, r)
            if oid is None:
                continue
            mode = b"40000"
        elif stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                oid = obj(b"blob", f.read())
            mode = b"100755" if st.st_mode & stat.S_IXUSR else b"100644"
        else:
            sys.exit("not a file, folder or symlink: " + p)
        if mode != b"40000":
            files.append([mode.decode(), oid.hex(), r])
        entries.append((os.fsencode(n) + (b"/" if mode == b"40000" else b""), mode, os.fsencode(n), oid))
    if not entries:
        return None
    entries.sort()
    return obj(b"tree", b"".join(m + b" " + n + b"\\0" + o for _, m, n, o in entries))
if not os.path.isdir(root):
    sys.exit("no such folder: " + root)
t = tree(root, "")
print(json.dumps({"tree": t.hex() if t else None, "files": sorted(files, key=lambda x: x[2]),
                  "excluded": sorted(excluded)}))"""


def check_git_tree(ctx: Context, check: Check) -> str:
    p = check.params
    path = _package_dir(ctx, check, p["module"]) if p.get("module") else p["path"]
    out = _python(ctx, check, _GIT_TREE, path, "\n".join(p["exclude"]))
    if out.rc != 0:
        raise CheckFailed(f"hashing {path} failed: {_last(out.stderr) or f'exit {out.rc}'}")
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    for mode, oid, rel in doc["files"]:  # the listing `git ls-tree -r` gives, to find what differs
        ctx.log(f"[{check.id}] {mode} blob {oid}\t{rel}\n")
    skipped = f", {len(doc['excluded'])} excluded ({', '.join(p['exclude'])})" if doc["excluded"] else ""
    what = f"{path}: git tree {doc['tree']} of {len(doc['files'])} file(s){skipped}"
    if doc["tree"] != p["tree"]:
        raise CheckFailed(f"{what}, expected {p['tree']}: not the same files (the gate log lists each file's "
                          "blob id, as `git ls-tree -r` does)")
    return what


CHECKS: dict[str, Callable[[Context, Check], str]] = {
    "import": check_import, "version": check_version, "command": check_command, "file": check_file,
    "metadata": check_metadata, "expression": check_expression, "elf": check_elf,
    "pip-check": check_pip_check, "cuda-targets": check_cuda_targets, "git-tree": check_git_tree,
}
