"""`make kernels`: real vLLM CUDA objects, configured by the real tree's CMake and compiled here,
on a machine without a GPU, for glm53-jovian-r12's TORCH_CUDA_ARCH_LIST; then gated.

Phases (each timed; the report at the end says what was built):
1. install: a venv in the work folder ($IMAGEBUILD_KERNELS_DIR, default ~/.cache/imagebuild-kernels)
   with PyPI's CUDA build of torch (TORCH, the operators' pin), cmake and ninja, then the CUDA
   toolchain wheels of the CUDA minor that torch was built with, taken from torch's own
   ``cuda-toolkit[...]==X`` requirement: ``cuda-toolkit[nvcc,crt,cccl,nvvm,cudart]==X``. One minor for
   everything, because the wheels share one root (``site-packages/nvidia/cu13``): CMake's
   FindCUDAToolkit and torch's Caffe2 config read nvcc, the runtime headers and the libraries from
   that root, and a second minor's nvcc there would mix 13.x headers. cuobjdump has no wheel before
   13.2, so it comes from the oldest 13.x wheel (NEWER) into a folder of its own, with that minor's
   nvcc, crt, nvvm, cccl and runtime: the "newer toolkit than the nodes' driver takes" of phase 4.
   The machine's pip config is used for its index and certificate only (read at run time with
   ``pip config list``): a find-links folder or a constraints file there (CPU torch, version caps)
   would pick another torch.
2. trees: the real vLLM snapshot (../shared/upstream, sha256 checked), once as is and once with
   patches-eugr/patch_vllm_preserve_sm12x_target.py applied by imagebuild's own patcher; the real
   flash-attention snapshot at the commit the tree declares (bce29425), with the cutlass headers its
   csrc/cutlass submodule names (62750a2b).
3. configure: ``cmake -G Ninja`` on the real CMakeLists.txt of each tree (VLLM_TARGET_DEVICE=cuda,
   TORCH_CUDA_ARCH_LIST=12.1a, FETCHCONTENT_FULLY_DISCONNECTED=ON). The tree fetches CUTLASS,
   triton_kernels, DeepGEMM, FlashMLA, QuTLASS and vllm-flash-attn at configure time; vllm-flash-attn
   is the real flash-attention tree (VLLM_FLASH_ATTN_SRC_DIR), so its own CMake picks FA2's targets;
   none of the others is compiled into or included by the objects built here, so each gets an empty
   stand-in folder through the tree's own ``*_SRC_DIR`` override (STANDINS says what each holds and why).
4. build: ``ninja`` builds the object files of TARGETS (the NVFP4 KV-cache kernel of ``_C`` and the
   NVFP4 quantizer of ``_C_stable_libtorch``), with the compile lines CMake generated; they are linked
   into one shared object ``<out>/<tree>/vllm/_C.abi3.so`` by the toolchain's host compiler. In the
   patched tree also one real FA2 source (FA2_SOURCE) of ``_vllm_fa2_C``, linked into
   ``vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so``; and the same compile line once more with the NEWER
   nvcc (``<out>/newer``: the patched NVFP4 objects beside that FA2).
5. gate: glm53's own ``vllm-cuda-targets`` check (docker-images/glm53-jovian-r12/gate.yaml) runs on
   each folder through imagebuild.gate.checks.check_cuda_targets on the local host, with the wheel's
   cuobjdump. The three verdicts (issue 29): the patched tree, FA2 built per its own list, must PASS;
   the unpatched one (NVFP4 collapsed to sm_120f) must FAIL; FA2's PTX from the NEWER nvcc must FAIL
   for the nodes' R580 driver (PTX ISA 9.2 > 9.0).

Exit status: 0 when every gate verdict is as expected, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IMAGE = "glm53-jovian-r12"
TORCH = "2.13.0"                    # the operators' pin (docs/images/glm53-jovian-r12.md)
NEWER = "13.2.*"                    # the first CUDA minor with a cuobjdump wheel; newer than R580 (13.0) takes
NEWER_PACKAGES = ("nvidia-cuda-cuobjdump", "nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl",
                  "nvidia-cuda-runtime")
FA_TARBALL = "flash-attention-bce29425-subset.tar.gz"
FA_SHA256 = "31b29160c5c6d5de4bb5b39daa9c88bdede061fce4b444188240ea2861e2d535"        # ../shared/upstream/README.md
CUTLASS_TARBALL = "cutlass-62750a2b-include.tar.gz"
CUTLASS_SHA256 = "8c09a2a2e45c50419e08eb175f51165b1a5106570cd196773f31e97e59af8095"
FA2_TARGET = "_vllm_fa2_C"
FA2_SOURCE = "csrc/flash_attn/src/flash_fwd_hdim32_fp16_sm80.cu"   # one FA2 forward instantiation, the smallest head dim
TOOLCHAIN_EXTRAS = "nvcc,crt,cccl,nvvm,cudart"
PATCH = ROOT / "patches-eugr" / "patch_vllm_preserve_sm12x_target.py"
UPSTREAM = ROOT.parent / "shared" / "upstream"
VLLM_TARBALL = "vllm-28be48fa.tar.gz"
VLLM_SHA256 = "434d26d8746a4d4e947d99b9d9f70dd5376f557977b4f0775d50a46e85b4afc4"  # tests/realtrees.py

# (CMake target, source): the objects built, each a kernel glm53's gate requires
TARGETS = (
    ("_C", "csrc/nvfp4_kv_cache_kernels.cu"),
    ("_C_stable_libtorch", "csrc/libtorch_stable/quantization/fp4/nvfp4_quant_kernels.cu"),
)

# the tree's FetchContent dependencies: (override variable, FetchContent name, why a stand-in will do).
# Each stand-in is an empty folder with an empty file at every path the tree's CMake names inside it
# (``${<name>_SOURCE_DIR}/...``): FlashMLA's CMake reads flash_mla_interface.py at configure time and
# QuTLASS adds its .cu files to _C, which CMake wants to exist when it generates.
STANDINS = (
    ("VLLM_CUTLASS_SRC_DIR", "cutlass",
     "no CMakeLists.txt, so FetchContent adds nothing; neither object includes CUTLASS"),
    ("TRITON_KERNELS_SRC_DIR", "triton_kernels", "Python files, copied at install time only"),
    ("DEEPGEMM_SRC_DIR", "deepgemm", "no target for 12.1a (its archs are 9.0a and 10.0f)"),
    ("FLASH_MLA_SRC_DIR", "flashmla", "no target for 12.1a (9.0a, 10.0f)"),
    ("QUTLASS_SRC_DIR", "qutlass", "its sources go into _C, whose link is not built here; its empty "
     "third_party/cutlass/include/cutlass/cutlass.h meets its configure-time check for CUTLASS headers"),
)
# vllm-flash-attn is the real tree (trees(): VLLM_FLASH_ATTN_SRC_DIR), not a stand-in


@dataclass
class Report:
    times: dict[str, float] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def phase(self, name: str, started: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + time.monotonic() - started
        say(f"== {name}: {self.times[name]:.1f} s")


def say(msg: str) -> None:
    print(msg, flush=True)


def run(cmd: list[str], *, env: dict | None = None, cwd: Path | None = None, log: Path | None = None,
        capture: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure print the tail of its output (or log) and exit 1."""
    say("$ " + " ".join(shlex.quote(str(c)) for c in cmd))
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as fh:
            res = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                 text=True)
        if res.returncode != 0:
            tail = log.read_text(errors="replace").splitlines()[-60:]
            sys.exit(f"exit {res.returncode} (log {log}):\n" + "\n".join(tail))
        return res
    res = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, text=True,
                         capture_output=capture)
    if res.returncode != 0:
        sys.exit(f"exit {res.returncode}: {(res.stderr or '')[-4000:]}")
    return res


# --- 1. install ------------------------------------------------------------------------------------

def pip_index_args(config_list: str) -> list[str]:
    """pip options for the index and certificate of ``pip config list`` output, nothing else.

    Lines look like ``global.extra-index-url='a b'`` or ``:env:.cert='/x'``; find-links and
    constraint are left out on purpose (module docstring)."""
    keep = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "cert": "--cert",
            "trusted-host": "--trusted-host"}
    seen: dict[str, list[str]] = {}
    for line in config_list.splitlines():
        m = re.match(r"^([^=]*?)\.([a-z-]+)='(.*)'$", line.strip())
        if not m or m.group(2) not in keep:
            continue
        scope, key, value = m.groups()
        # the most specific scope wins; within pip's listing, later lines are more specific
        seen[key] = value.split() if key in ("extra-index-url", "trusted-host") else [value]
        del scope
    args: list[str] = []
    for key, opt in keep.items():
        for v in seen.get(key, []):
            args += [opt, v]
    return args


def clean_pip_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") or k in ("PIP_DEFAULT_TIMEOUT", "PIP_DISABLE_PIP_VERSION_CHECK")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def toolchain_pin(requires: list[str]) -> str:
    """The cuda-toolkit version torch's metadata pins (``cuda-toolkit[...]==13.0.3; ...``)."""
    for req in requires:
        m = re.match(r"^cuda-toolkit(?:\[[^\]]*\])?\s*==\s*([0-9][0-9.]*)", req)
        if m:
            return m.group(1)
    raise SystemExit(f"torch {TORCH} names no cuda-toolkit==X requirement: is it a CUDA build? {requires}")


@dataclass
class Venv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def site(self) -> Path:
        return Path(run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        capture=True).stdout.strip())


def install(work: Path, rep: Report) -> tuple[Venv, Path, dict]:
    t = time.monotonic()
    venv = Venv(work / "venv")
    stamp = venv.root / ".kernels-installed"
    cuobj_dir = work / "cuda-newer"
    if not stamp.is_file():
        cfg = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
        index = pip_index_args(cfg)
        env = clean_pip_env()
        if venv.root.exists():
            shutil.rmtree(venv.root)
        run([sys.executable, "-m", "venv", venv.root])
        pip = [venv.python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *index]
        run([*pip, "--upgrade", "pip"], env=env)
        run([*pip, f"torch=={TORCH}", "cmake", "ninja"], env=env)
        requires = json.loads(run([venv.python, "-c", "import importlib.metadata as m, json; "
                                   "print(json.dumps(m.requires('torch')))"], capture=True).stdout)
        pin = toolchain_pin(requires)
        run([*pip, f"cuda-toolkit[{TOOLCHAIN_EXTRAS}]=={pin}"], env=env)
        stamp.write_text(json.dumps({"torch": TORCH, "cuda-toolkit": pin}) + "\n")
    if not (cuobj_dir / ".installed").is_file():  # its own stamp: a work folder of an older script has none
        cfg = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
        if cuobj_dir.exists():
            shutil.rmtree(cuobj_dir)
        run([venv.python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pip_index_args(cfg),
             "--no-deps", "--only-binary", ":all:", "--target", cuobj_dir,
             *(f"{p}=={NEWER}" for p in NEWER_PACKAGES)], env=clean_pip_env())
        (cuobj_dir / ".installed").write_text(NEWER + "\n")
    info = json.loads(run([venv.python, "-c",
                           "import json, torch, importlib.metadata as m; print(json.dumps({"
                           "'torch': torch.__version__, 'cuda': torch.version.cuda, "
                           "'toolkit': m.version('cuda-toolkit'), 'nvcc': m.version('nvidia-cuda-nvcc'), "
                           "'cmake': m.version('cmake'), 'ninja': m.version('ninja')}))"],
                          capture=True).stdout)
    cuobjdump = next(cuobj_dir.glob("nvidia/cu*/bin/cuobjdump"), None)
    if cuobjdump is None:
        raise SystemExit(f"{cuobj_dir}: no nvidia/cu*/bin/cuobjdump")
    info["cuobjdump"] = str(cuobjdump)
    info["venv_mb"] = du_mb(venv.root)
    rep.lines.append(f"torch {info['torch']} (CUDA {info['cuda']}); cuda-toolkit {info['toolkit']} "
                     f"(nvcc {info['nvcc']}); cmake {info['cmake']}; ninja {info['ninja']}; "
                     f"venv {info['venv_mb']} MB")
    rep.phase("install", t)
    return venv, cuobjdump, info


def du_mb(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total // (1 << 20)


# --- 2. trees --------------------------------------------------------------------------------------

def trees(work: Path, rep: Report) -> dict[str, Path]:
    """{"patched": tree, "unpatched": tree}, extracted afresh from the snapshot."""
    from imagebuild.definition import patching

    t = time.monotonic()
    tarball = UPSTREAM / VLLM_TARBALL
    if not tarball.is_file():
        raise SystemExit(f"{tarball} is absent: `make kernels` needs ../shared/upstream beside the project")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != VLLM_SHA256:
        raise SystemExit(f"{tarball}: sha256 {digest}, expected {VLLM_SHA256}")
    out = {}
    for name in ("patched", "unpatched"):
        dest = work / "trees" / name
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        with tarfile.open(tarball) as tf:
            tf.extractall(dest, filter="data")
        out[name] = dest / "vllm"
    [res] = patching.apply_all([PATCH], out["patched"])
    if res.outcome != patching.APPLIED:
        raise SystemExit(f"{PATCH.name}: {res.as_dict()}")
    fa = work / "trees" / "flash-attention"
    if fa.exists():
        shutil.rmtree(fa)
    for name, digest, dest in ((FA_TARBALL, FA_SHA256, fa), (CUTLASS_TARBALL, CUTLASS_SHA256, fa / "csrc" / "cutlass")):
        tarball = UPSTREAM / name
        if not tarball.is_file():
            raise SystemExit(f"{tarball} is absent: `make kernels` needs ../shared/upstream beside the project")
        got = hashlib.sha256(tarball.read_bytes()).hexdigest()
        if got != digest:
            raise SystemExit(f"{tarball}: sha256 {got}, expected {digest}")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball) as tf:  # no top folder in these two (README.md)
            tf.extractall(dest, filter="data")
    out["flash-attention"] = fa
    rep.lines.append(f"trees: {VLLM_TARBALL} (sha256 ok); {PATCH.name}: {res.outcome} on the patched copy; "
                     f"{FA_TARBALL} with {CUTLASS_TARBALL} as its csrc/cutlass (sha256 ok)")
    rep.phase("trees", t)
    return out


# --- 3. configure ----------------------------------------------------------------------------------

def standin_files(tree: Path, name: str) -> list[str]:
    """The paths inside dependency ``name`` that the tree's CMake files name."""
    files = [tree / "CMakeLists.txt", *sorted((tree / "cmake").rglob("*.cmake"))]
    pat = re.compile(r"\$\{" + re.escape(name) + r"_SOURCE_DIR\}/([A-Za-z0-9_./-]+\.[A-Za-z0-9]+)")
    found = {m.group(1) for f in files for m in pat.finditer(f.read_text(errors="replace"))}
    return sorted(found)


def standins(work: Path, tree: Path) -> dict[str, Path]:
    base = work / "standins" / tree.parent.name
    out = {"VLLM_FLASH_ATTN_SRC_DIR": work / "trees" / "flash-attention"}  # the real tree (trees())
    for var, name, _why in STANDINS:
        d = base / name
        for f in standin_files(tree, name):
            (d / f).parent.mkdir(parents=True, exist_ok=True)
            (d / f).touch()
        d.mkdir(parents=True, exist_ok=True)
        out[var] = d
    return out


def cuda_root(site: Path) -> Path:
    roots = sorted(site.glob("nvidia/cu*/bin/nvcc"))
    if not roots:
        raise SystemExit(f"{site}: no nvidia/cu*/bin/nvcc (the nvidia-cuda-nvcc wheel)")
    return roots[-1].parent.parent


def link_names(root: Path) -> list[str]:
    """Fix 1: the wheels ship each library under its soname only (``libcudart.so.13``); CMake's
    find_library (torch's FindCUDA: CUDA_CUDART_LIBRARY) looks for the linker name ``libcudart.so``.
    Adds ``lib/libX.so -> libX.so.N`` where it is missing; returns the names added.
    Fix 2: nvcc.profile links from ``$(TOP)/lib64`` (and ``lib64/stubs``), the wheels install
    ``lib``: CMake's CUDA compiler check fails with "cannot find -lcudadevrt, -lcudart_static".
    Adds ``lib64 -> lib``."""
    added = []
    if not (root / "lib64").exists():
        (root / "lib64").symlink_to("lib")
        added.append("lib64")
    for lib in sorted((root / "lib").glob("lib*.so.*")):
        m = re.match(r"^(lib[^.]+)\.so\.[0-9]+$", lib.name)
        link = root / "lib" / f"{m.group(1)}.so" if m else None
        if link is not None and not link.exists():
            link.symlink_to(lib.name)
            added.append(link.name)
    return added


def driver_stub(work: Path) -> Path:
    """Fix 3: the CUDA driver library (libcuda.so) is in no wheel (a toolkit has it under
    lib64/stubs; a wheel install has none), so FindCUDAToolkit defines no CUDA::cuda_driver and
    generating fails: 'Target "_C" links to: CUDA::cuda_driver but the target was not found'. Nothing
    here links against it; an empty shared object stands in (CUDA_cuda_driver_LIBRARY)."""
    stub = work / "stubs" / "libcuda.so"
    if not stub.is_file():
        stub.parent.mkdir(parents=True, exist_ok=True)
        run(["gcc", "-shared", "-o", stub, "-x", "c", os.devnull])
    return stub


def build_env(venv: Venv, root: Path, stand: dict[str, Path]) -> dict:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(venv.root / "bin"), str(root / "bin"), env.get("PATH", "")])
    env["CUDA_HOME"] = env["CUDA_PATH"] = str(root)
    env["CUDAToolkit_ROOT"] = str(root)
    env["TORCH_CUDA_ARCH_LIST"] = ARCH_LIST
    env.pop("VLLM_PRESERVE_SM12X_TARGET", None)
    for var, d in stand.items():
        env[var] = str(d)
    return env


def cmake_args(venv: Venv, root: Path, tree: Path, build: Path, stand: dict[str, Path]) -> list:
    return [venv.root / "bin" / "cmake", "-G", "Ninja", "-S", tree, "-B", build,
            f"-DCMAKE_MAKE_PROGRAM={venv.root / 'bin' / 'ninja'}",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DVLLM_TARGET_DEVICE=cuda",
            f"-DVLLM_PYTHON_EXECUTABLE={venv.python}",
            f"-DCMAKE_CUDA_COMPILER={root / 'bin' / 'nvcc'}",
            f"-DCUDAToolkit_ROOT={root}",
            f"-DCUDA_cuda_driver_LIBRARY={driver_stub(build.parent.parent)}",
            "-DFETCHCONTENT_FULLY_DISCONNECTED=ON",
            "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"]


ARCH_LIST = "12.1a"  # glm53-jovian-r12's TORCH_CUDA_ARCH_LIST (checked against its definition in main)


def configure(work: Path, venv: Venv, root: Path, tree: Path, name: str, rep: Report) -> Path:
    t = time.monotonic()
    stand = standins(work, tree)
    build = work / "build" / name
    if build.exists():
        shutil.rmtree(build)
    run(cmake_args(venv, root, tree, build, stand), env=build_env(venv, root, stand),
        log=work / "logs" / f"configure-{name}.log")
    text = (work / "logs" / f"configure-{name}.log").read_text(errors="replace")
    # vLLM's own filter and NVFP4 archs, then flash-attention's filter and FA2_ARCHS (its CMake runs second)
    for pat in (r"Building NVFP4 for archs: \S+", r"CUDA supported target architectures: \S+", r"FA2_ARCHS: \S*"):
        for m in re.finditer(pat, text):
            rep.lines.append(f"configure {name}: {m.group(0)}")
    rep.phase(f"configure {name}", t)
    return build


def selection(build: Path) -> dict[str, dict[tuple[str, ...], list[str]]]:
    """What CMake chose for every CUDA source: {target: {(device targets...): [sources]}}, the
    device targets as the gate names them (``sm_121a`` for SASS, ``compute_80`` for PTX)."""
    out: dict[str, dict[tuple[str, ...], list[str]]] = {}
    for c in json.loads((build / "compile_commands.json").read_text()):
        m = re.search(r"CMakeFiles/([^/]+)\.dir/", c.get("output") or c["command"])
        codes = re.findall(r"-gencode[= ]arch=\S+?,code=(\S+)", c["command"])
        if not m or not codes:
            continue
        key = tuple(sorted(set(codes)))
        src = c["file"].split("/vllm/", 1)[-1]
        out.setdefault(m.group(1), {}).setdefault(key, []).append(src)
    return out


def selection_lines(sel: dict[str, dict[tuple[str, ...], list[str]]], allowed: set[str]) -> list[str]:
    """One line a target: how many CUDA sources, and those whose targets the gate would refuse."""
    lines = []
    for target in sorted(sel):
        groups = sel[target]
        total = sum(len(v) for v in groups.values())
        bad = sorted(((k, v) for k, v in groups.items() if set(k) - allowed), key=lambda kv: -len(kv[1]))
        ok = total - sum(len(v) for _k, v in bad)
        parts = [f"{len(v)} {'+'.join(k)} (e.g. {v[0]})" for k, v in bad]
        lines.append(f"{target}: {total} CUDA sources, {ok} within the gate's targets"
                     + (f"; outside them: {'; '.join(parts)}" if parts else ""))
    return lines


# --- 4. build --------------------------------------------------------------------------------------

@dataclass
class Built:
    tree: str
    target: str
    source: str
    obj: Path
    so: Path
    gencode: list[str]


def object_of(build: Path, target: str, source: str) -> tuple[str, list[str]]:
    """(the ninja path of ``source``'s object in ``target``, its -gencode flags), from CMake's
    compile_commands.json."""
    cmds = json.loads((build / "compile_commands.json").read_text())
    for c in cmds:
        if c["file"].endswith("/" + source) and f"CMakeFiles/{target}.dir/" in c.get("output", c["command"]):
            out = c.get("output") or re.search(r"-o (\S+)", c["command"]).group(1)
            if Path(out).is_absolute():  # ninja names its outputs relative to the build folder
                out = str(Path(out).relative_to(build))
            gencode = [f"-gencode {g}" for g in re.findall(r"-gencode[= ](arch=\S+?,code=\S+)", c["command"])]
            return out, gencode
    raise SystemExit(f"{build}: CMake generated no compile line for {source} in {target} "
                     f"(the tree's CMake did not add it: no architecture selected?)")


def build_objects(work: Path, venv: Venv, root: Path, tree: Path, build: Path, name: str,
                  rep: Report, fa2: Built | None = None) -> list[Built]:
    """TARGETS' objects, and FA2_SOURCE's (compiled here when ``fa2`` is None, else that one's copied)."""
    t = time.monotonic()
    stand = standins(work, tree)
    env = build_env(venv, root, stand)
    out_dir = work / "out" / name / "vllm"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    built = []
    for target, source in TARGETS:
        obj, gencode = object_of(build, target, source)
        run([venv.root / "bin" / "ninja", "-C", build, obj], env=env,
            log=work / "logs" / f"build-{name}-{Path(source).stem}.log")
        so = out_dir / f"{target}.abi3.so"
        run(["g++", "-shared", "-o", so, build / obj], env=env)
        built.append(Built(name, target, source, build / obj, so, gencode))
    fa2_so = out_dir / "vllm_flash_attn" / f"{FA2_TARGET}.abi3.so"
    fa2_so.parent.mkdir()
    obj, gencode = object_of(build, FA2_TARGET, FA2_SOURCE)
    if fa2 is None:  # one real FA2 object, compiled with the lines flash-attention's own CMake generated
        run([venv.root / "bin" / "ninja", "-C", build, obj], env=env,
            log=work / "logs" / f"build-{name}-{Path(FA2_SOURCE).stem}.log")
        run(["g++", "-shared", "-o", fa2_so, build / obj], env=env)
        built.append(Built(name, FA2_TARGET, FA2_SOURCE, build / obj, fa2_so, gencode))
    else:  # the same FA2 library: its list does not depend on vLLM's patch (checked here)
        if gencode != fa2.gencode:
            raise SystemExit(f"{name}: flash-attention's CMake chose {gencode} for FA2, the patched tree {fa2.gencode}")
        shutil.copy(fa2.so, fa2_so)
    rep.phase(f"build {name}", t)
    return built


def build_newer_fa2(work: Path, venv: Venv, root: Path, tree: Path, build: Path, newer_nvcc: Path,
                    patched: list[Built], rep: Report) -> list[Built]:
    """FA2_SOURCE once more, on the compile line flash-attention's CMake generated, with the NEWER
    nvcc in place of the toolkit's; ``<out>/newer/vllm`` holds it beside the patched NVFP4 objects."""
    t = time.monotonic()
    env = build_env(venv, root, standins(work, tree))
    [cmd] = [c for c in json.loads((build / "compile_commands.json").read_text())
             if c["file"].endswith("/" + FA2_SOURCE) and f"CMakeFiles/{FA2_TARGET}.dir/" in c.get("output", c["command"])]
    argv = shlex.split(cmd["command"])
    obj = work / "newer" / f"{Path(FA2_SOURCE).name}.o"
    obj.parent.mkdir(parents=True, exist_ok=True)
    argv[0] = str(newer_nvcc)
    for flag, value in (("-o", obj), ("-MF", obj.with_suffix(".d"))):
        if flag in argv:
            argv[argv.index(flag) + 1] = str(value)
    run(argv, env=env, cwd=Path(cmd["directory"]), log=work / "logs" / f"build-newer-{Path(FA2_SOURCE).stem}.log")
    out_dir = work / "out" / "newer" / "vllm"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    (out_dir / "vllm_flash_attn").mkdir(parents=True)
    for b in patched:
        if b.target != FA2_TARGET:
            shutil.copy(b.so, out_dir / b.so.name)
    so = out_dir / "vllm_flash_attn" / f"{FA2_TARGET}.abi3.so"
    run(["g++", "-shared", "-o", so, obj], env=env)
    gencode = [f"-gencode {g}" for g in re.findall(r"-gencode[= ](arch=\S+?,code=\S+)", cmd["command"])]
    rep.phase("build newer", t)
    return [Built("newer", FA2_TARGET, FA2_SOURCE, obj, so, gencode)]


# --- 5. gate ---------------------------------------------------------------------------------------

def describe(cuobjdump: Path, b: Built) -> str:
    from imagebuild.gate import cuda_targets

    listing = run([cuobjdump, "--dump-resource-usage", b.so], capture=True).stdout
    fb = cuda_targets.parse_listing(listing)
    named = ", ".join(f"{sum(1 for k in fb.kernels if re.search(pat, k))} /{pat}/"
                      for pat in glm53_check().params["kernels"])
    return (f"{b.tree}: {b.target} <- {b.source}: {b.so.name} {b.so.stat().st_size:,} B "
            f"(object {b.obj.stat().st_size:,} B); {' '.join(b.gencode) or 'no -gencode'}; "
            f"SASS {' '.join(sorted(fb.sass)) or '-'}; PTX {' '.join(sorted(fb.ptx)) or '-'}; "
            f"{len(fb.kernels)} kernels ({named})")


def glm53_check():
    """glm53-jovian-r12's cuda-targets check (gate.yaml)."""
    from imagebuild.definition import gatespec
    from imagebuild.definition import reader as definition

    spec = gatespec.load(definition.load(ROOT, IMAGE).dir / "gate.yaml")
    [check] = [c for c in spec.checks if c.kind == "cuda-targets"]
    return check


def gate(folder: Path, cuobjdump: Path) -> tuple[bool, str, list[str]]:
    """glm53's own cuda-targets check on ``folder`` (passed, detail, the check's log lines)."""
    import testinfra

    from imagebuild.definition import gatespec
    from imagebuild.gate import checks

    check = glm53_check()
    params = {k: v for k, v in check.params.items() if k != "module"}
    params.update(path=str(folder), cuobjdump=str(cuobjdump))
    log: list[str] = []
    ctx = checks.Context(testinfra.get_host("local://"), "python3", {}, log.append)
    try:
        return True, checks.check_cuda_targets(ctx, gatespec.Check(check.id, check.kind, params)), log
    except checks.CheckFailed as exc:
        return False, exc.detail, log


# --- main ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None,
                    help="work folder (default $IMAGEBUILD_KERNELS_DIR or ~/.cache/imagebuild-kernels)")
    ap.add_argument("--patched-only", action="store_true", help="skip the unpatched tree")
    args = ap.parse_args(argv)
    work = args.work or Path(os.environ.get("IMAGEBUILD_KERNELS_DIR")
                             or Path.home() / ".cache" / "imagebuild-kernels")
    work.mkdir(parents=True, exist_ok=True)
    check_arch_list()
    rep = Report()
    started = time.monotonic()
    venv, cuobjdump, _info = install(work, rep)
    root = cuda_root(venv.site())
    rep.lines.append(f"CUDA root: {root} (nvcc {nvcc_release(root)})")
    added = link_names(root)
    if added:
        rep.lines.append(f"linker names added in {root / 'lib'}: {' '.join(added)}")
    trees_ = ["patched"] if args.patched_only else ["patched", "unpatched"]
    all_trees = trees(work, rep)
    built: dict[str, list[Built]] = {}
    builds: dict[str, Path] = {}
    for name in trees_:
        build = builds[name] = configure(work, venv, root, all_trees[name], name, rep)
        params = glm53_check().params
        allowed = set(params["sass"]) | set(params.get("ptx") or []) | set(params.get("tolerate") or [])
        for line in selection_lines(selection(build), allowed):
            rep.lines.append(f"selected {name}: {line}")
        fa2 = next((b for b in built.get("patched", []) if b.target == FA2_TARGET), None)
        built[name] = build_objects(work, venv, root, all_trees[name], build, name, rep, fa2)
    newer_nvcc = cuobjdump.parent / "nvcc"
    built["newer"] = build_newer_fa2(work, venv, root, all_trees["patched"], builds["patched"], newer_nvcc,
                                     built["patched"], rep)
    rep.lines.append(f"newer toolkit: {newer_nvcc} (nvcc {nvcc_release(newer_nvcc.parent.parent)})")
    names = [*trees_, "newer"]
    t = time.monotonic()
    verdicts, details = {}, {}
    for name in names:
        ok, detail, log = gate(work / "out" / name / "vllm", cuobjdump)
        verdicts[name], details[name] = ok, detail
        for line in log:  # the check's one line a file (the rest of its log is the commands it ran)
            if re.match(r"^\[[^\]]+\] /\S+: (SASS|unreadable)", line):
                say("  " + line.rstrip())
        rep.lines.append(f"gate {name}: {'PASS' if ok else 'FAIL'}: {detail}")
    rep.phase("gate", t)
    say("\n=== what was built")
    for name in names:
        for b in built[name]:
            say("  " + describe(cuobjdump, b))
    say("=== report")
    for line in rep.lines:
        say("  " + line)
    say("=== times: " + "; ".join(f"{k} {v:.1f} s" for k, v in rep.times.items())
        + f"; total {time.monotonic() - started:.1f} s")
    say("=== gate verdicts (glm53's vllm-cuda-targets, as glm53 runs it)")
    good = True
    for name, what, want, because in VERDICTS:
        if name not in verdicts:
            continue
        as_expected = verdicts[name] == want and (because is None or because in details[name])
        good &= as_expected
        say(f"  {what}: {'PASS' if verdicts[name] else 'FAIL'} "
            f"({'as expected' if as_expected else 'UNEXPECTED: expected ' + ('PASS' if want else 'FAIL')})")
    say("kernels: " + ("OK" if good else "UNEXPECTED"))
    return 0 if good else 1


# (folder, what it is, expected verdict, a phrase the detail must hold)
VERDICTS = (
    ("patched", "FA2 built per its own list (sm_80 + compute_80, nvcc of the image's CUDA) beside "
     "NVFP4 sm_121a (patched tree)", True, None),
    ("unpatched", "NVFP4 collapsed to 12.0 (unpatched tree: sm_120f)", False, "unexpected target sm_120f"),
    ("newer", "FA2's PTX compiled by a newer toolkit than the R580 driver takes (nvcc 13.2)", False, "cannot JIT"),
)


def nvcc_release(root: Path) -> str:
    out = run([root / "bin" / "nvcc", "--version"], capture=True).stdout
    m = re.search(r"release ([0-9.]+)", out)
    return m.group(1) if m else "?"


def check_arch_list() -> None:
    """ARCH_LIST is glm53's TORCH_CUDA_ARCH_LIST: the definition says so, or the script stops."""
    from imagebuild.definition import reader as definition

    got = definition.load(ROOT, IMAGE).env.get("TORCH_CUDA_ARCH_LIST")
    if got != ARCH_LIST:
        raise SystemExit(f"{IMAGE} sets TORCH_CUDA_ARCH_LIST={got!r}; this script builds for {ARCH_LIST}")


if __name__ == "__main__":
    sys.exit(main())
