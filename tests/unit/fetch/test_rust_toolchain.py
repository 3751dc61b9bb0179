"""prefetch refuses a lock whose Rust crates the image could not build: the rustc an apt list installs
below the stage that builds them must be at least the highest ``rust-version`` the tree or its
vendored crates declare (fetch/prefetch.check_rust_toolchain, fetch/cargo.py)."""

from __future__ import annotations

import pytest

from imagebuild.core.errors import OperationFailed
from imagebuild.definition import reader as d
from imagebuild.definition.model import Parent
from imagebuild.fetch import cargo
from imagebuild.fetch.prefetch import check_rust_toolchain


def test_rust_version_of_a_manifest():
    assert cargo.manifest_rust_version('[package]\nname = "a"\nrust-version = "1.80"\n') == "1.80"
    assert cargo.manifest_rust_version('[workspace]\n[workspace.package]\nrust-version = "1.82.0"\n') == "1.82.0"
    # inherited from the workspace (a table), absent, or not TOML: nothing declared here
    assert cargo.manifest_rust_version('[package]\nrust-version.workspace = true\n') is None
    assert cargo.manifest_rust_version('[package]\nname = "a"\n') is None
    assert cargo.manifest_rust_version('[package\n') is None
    assert cargo.version_tuple("1.75.0+dfsg0ubuntu1-0ubuntu1") == (1, 75, 0)
    assert cargo.version_tuple("1.80") == (1, 80, 0) and cargo.version_tuple("noble") is None
    assert cargo.highest([("1.70", "a"), (None, "b"), ("1.81", "c"), ("1.9", "d")]) == ("1.81", "c")
    assert cargo.highest([(None, "x")]) is None


def _definition(tmp_path, build_apt: str | None = None):
    img = tmp_path / "docker-images" / "rusty"
    img.mkdir(parents=True)
    (img / "versions.env").write_text("BASE_IMAGE=imagebuild-test/busybox:1\nAPP_REPO=https://example.invalid/app.git\n"
                                      "APP_REF=main\n")
    build = "    apt: build-apt.txt\n" if build_apt is not None else ""
    (img / "image.yaml").write_text(
        "platform: linux/amd64\nstages:\n"
        "  - name: tools\n    from: BASE_IMAGE\n    apt: apt.txt\n"
        f"  - name: build\n    from: tools\n    sources: [APP]\n{build}"
        "sources:\n  APP:\n    scan_fetchcontent: false\n")
    (img / "apt.txt").write_text("git=1:2.43.0-1ubuntu7\n")
    if build_apt is not None:
        (img / "build-apt.txt").write_text(build_apt)
    for st in ("tools", "build"):
        (img / f"Dockerfile.{st}").write_text("ARG PARENT\nFROM ${PARENT}\nRUN true\n")
    return d.load(tmp_path, "rusty")


def _lock(need, tools=(), build=()):
    files = lambda pkgs: [{"name": n, "version": v, "filename": f"{n}.deb"} for n, v in pkgs]  # noqa: E731
    return {"sources": {"APP": {"cargo": {"lockfiles": [{"path": "rust/Cargo.lock"}], "rust_version": need}}},
            "apt": {"tools": {"files": files(tools)}, **({"build": {"files": files(build)}} if build else {})}}


def test_a_new_enough_rustc_below_the_stage_passes(tmp_path):
    defn = _definition(tmp_path)
    lock = _lock(["1.80", "itoa-1.0.15"], tools=[("git", "1:2.43"), ("rustc", "1.80.1+dfsg0ubuntu1-0ubuntu1")])
    assert check_rust_toolchain(defn, lock) == []
    # nothing declared: any rustc will do
    assert check_rust_toolchain(defn, _lock(None, tools=[("rustc", "1.75.0+dfsg0ubuntu1-0ubuntu1")])) == []
    # no crates at all: nothing to say
    assert check_rust_toolchain(defn, {"sources": {"APP": {"cargo": None}}, "apt": {}}) == []


def test_an_older_rustc_is_refused_naming_the_list_the_version_and_the_crate(tmp_path):
    defn = _definition(tmp_path, build_apt="rustc=1.75.0+dfsg0ubuntu1-0ubuntu1\ncargo=1.75.0+dfsg0ubuntu1-0ubuntu1\n")
    lock = _lock(["1.82", "rust/Cargo.toml"], build=[("rustc", "1.75.0+dfsg0ubuntu1-0ubuntu1"), ("cargo", "1.75.0")])
    with pytest.raises(OperationFailed) as exc:
        check_rust_toolchain(defn, lock)
    msg = exc.value.message
    assert "build-apt.txt" in msg and "rustc=1.75.0+dfsg0ubuntu1-0ubuntu1" in msg
    assert "1.82" in msg and "rust/Cargo.toml" in msg and "'build'" in msg
    # the newest rustc of the chain counts: a versioned toolchain in the stage's own list
    lock = _lock(["1.82", "rust/Cargo.toml"], tools=[("rustc", "1.75.0")], build=[("rustc-1.83", "1.83.0+dfsg-0ubuntu1")])
    assert check_rust_toolchain(defn, lock) == []


def test_no_rustc_in_any_apt_list_is_a_warning_the_base_may_carry_one(tmp_path):
    defn = _definition(tmp_path)
    [w] = check_rust_toolchain(defn, _lock(["1.80", "itoa-1.0.15"], tools=[("git", "1:2.43")]))
    assert "'build'" in w and "no apt list" in w and "1.80 (itoa-1.0.15)" in w


def test_glm53_builds_its_rust_frontend_with_the_pinned_toolchain_and_apt_protoc_in_the_wheel_stage_only():
    """glm53's vllm-wheel stage installs protoc from apt (bare name, pinned by prefetch) and takes the
    Rust toolchain the tree names from its release archives (rust_toolchain: dist), not noble's 1.75;
    the runner starts from the torch stage, so neither reaches the served image."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    defn = d.load(root, "glm53-jovian-r12")
    wheel = defn.stage("vllm-wheel")
    assert {a.name for a in wheel.apt.items} == {"protobuf-compiler"}
    assert defn.source_options["VLLM"].rust_toolchain == "dist"
    assert defn.stage("runner").parent == Parent("stage", "torch")
    assert all(a.name not in ("rustc", "cargo", "protobuf-compiler") for st in ("apt", "torch")
               for a in (defn.stage(st).apt.items if defn.stage(st).apt else ()))
    df = wheel.dockerfile_bytes.decode()
    assert "install.sh" in df and "protoc --version" in df and "cargo --version" in df


# ------------------------------------------------------------------ what the tree asks for (fetch/rust.py)
NEWER_TREE = {  # the shape of the fork's newer trees (../shared/FACTS.md): no rust-version anywhere
    "rust-toolchain.toml": '[toolchain]\nchannel = "1.95"\ncomponents = ["rustfmt"]\n',
    "rust/Cargo.toml": '[workspace]\nmembers = ["parser"]\nresolver = "3"\n[workspace.package]\nedition = "2024"\n',
    "rust/parser/Cargo.toml": '[package]\nname = "parser"\nversion = "0.1.0"\nedition.workspace = true\n',
    "rust/Cargo.lock": "# generated\nversion = 4\n\n[[package]]\nname = \"parser\"\nversion = \"0.1.0\"\n",
    "third_party/x/Cargo.toml": '[package]\nname = "x"\nedition = "2024"\nrust-version = "1.99"\n',
}


def _needs(tree: dict[str, str], locks=("rust/Cargo.lock",)):
    from imagebuild.fetch import rust

    files = {p: p for p in tree}  # blob id = path, read from the dict
    return rust.tree_needs(files, list(locks), lambda b: tree[b])


def test_the_newer_tree_asks_for_its_toolchain_edition_and_lockfile_version():
    from imagebuild.fetch import rust

    needs, chains = _needs(NEWER_TREE)
    assert [n.as_list() for n in needs] == [
        ["1.95", "rust-toolchain.toml", 'channel = "1.95"'],
        ["1.85", "rust/Cargo.toml", 'edition = "2024"'],
        ["1.78", "rust/Cargo.lock", "version = 4"],
    ]
    assert rust.highest(needs).who == 'rust-toolchain.toml (channel = "1.95")'
    assert chains == [rust.Toolchain("rust-toolchain.toml", "1.95")]
    # the nearest toolchain file wins (rust/ over the root); a legacy bare rust-toolchain is read too
    tree = {**NEWER_TREE, "rust/rust-toolchain": "1.90.0\n"}
    needs, chains = _needs(tree)
    assert needs[0].as_list() == ["1.90.0", "rust/rust-toolchain", 'channel = "1.90.0"']
    # a channel that is no version is recorded, never turned into one
    needs, chains = _needs({**NEWER_TREE, "rust-toolchain.toml": '[toolchain]\nchannel = "nightly-2026-05-01"\n'})
    assert needs[0].version == "1.85" and chains[0].channel == "nightly-2026-05-01" and chains[0].version is None
    assert rust.lockfile_version("[[package]]\nname = \"a\"\nversion = \"4.0.0\"\n") is None  # a v1 lock


def test_debian_rustc_1_63_is_refused_for_the_newer_tree_naming_the_toolchain_file(tmp_path):
    """R4: bookworm's rustc 1.63 passed with no word (no crate declares rust-version)."""
    from imagebuild.fetch import rust

    needs, _ = _needs(NEWER_TREE)
    top = rust.highest(needs)
    defn = _definition(tmp_path, build_apt="rustc=1.63.0+dfsg1-2\ncargo=0.66.0+ds1-1\n")
    lock = _lock([top.version, top.who], build=[("rustc", "1.63.0+dfsg1-2"), ("cargo", "0.66.0+ds1-1")])
    lock["sources"]["APP"]["cargo"]["rust_needs"] = [n.as_list() for n in needs]
    with pytest.raises(OperationFailed) as exc:
        check_rust_toolchain(defn, lock)
    msg = exc.value.message
    assert "build-apt.txt: rustc=1.63.0+dfsg1-2 is older than the Rust 1.95" in msg
    assert 'rust-toolchain.toml (channel = "1.95")' in msg and "stage 'build' needs it to cargo-build rust/Cargo.lock" in msg
    assert 'rust/Cargo.toml (edition = "2024")' in msg and "rust/Cargo.lock (version = 4)" in msg
    # noble's 1.75 is refused too; a versioned rustc-1.95 passes
    lock["apt"]["build"]["files"][0]["version"] = "1.75.0+dfsg0ubuntu1-0ubuntu1"
    with pytest.raises(OperationFailed):
        check_rust_toolchain(defn, lock)
    lock["apt"]["build"]["files"].append({"name": "rustc-1.95", "version": "1.95.0+dfsg-0ubuntu1", "filename": "x.deb"})
    assert check_rust_toolchain(defn, lock) == []


BUILD_RS = 'fn main() -> Result<(), Box<dyn std::error::Error>> {\n    tonic_prost_build::configure()\n' \
           '        .compile_protos(&["proto/inference.proto"], &["proto"])?;\n    Ok(())\n}\n'


def test_a_build_script_that_runs_protoc_is_found_unless_the_tree_has_protox():
    from imagebuild.fetch import rust

    tree = {**NEWER_TREE, "rust/parser/build.rs": BUILD_RS,
            "third_party/x/build.rs": "fn main() { prost_build::compile_protos(&[], &[]).unwrap(); }\n"}
    files = {p: p for p in tree}
    got = rust.protoc_need(files, ["rust/Cargo.lock"], lambda b: tree[b])
    assert got == {"needed": True, "build_scripts": ["rust/parser/build.rs: tonic_prost_build"], "compiler": None}
    # vllm#52892: the descriptor set comes from protox, a crate in the Cargo.lock: no protoc needed
    tree["rust/Cargo.lock"] += '\n[[package]]\nname = "protox"\nversion = "0.9.0"\n'
    got = rust.protoc_need(files, ["rust/Cargo.lock"], lambda b: tree[b])
    assert got["needed"] is False and got["compiler"] == "protox"
    assert rust.protoc_need({p: p for p in NEWER_TREE}, ["rust/Cargo.lock"], lambda b: NEWER_TREE[b]) is None


def test_protoc_needed_and_no_apt_list_installs_it_is_refused_naming_the_build_script(tmp_path):
    """protoc: the tree's build.rs runs tonic_prost_build; no stage installed protoc and nothing said so."""
    defn = _definition(tmp_path, build_apt="rustc=1.95.0+dfsg-1\n")
    lock = _lock(["1.95", 'rust-toolchain.toml (channel = "1.95")'], build=[("rustc", "1.95.0+dfsg-1")])
    lock["sources"]["APP"]["cargo"]["protoc"] = {"needed": True, "compiler": None,
                                                 "build_scripts": ["rust/build.rs: tonic_prost_build"]}
    with pytest.raises(OperationFailed) as exc:
        check_rust_toolchain(defn, lock)
    msg = exc.value.message
    assert "APP: rust/build.rs: tonic_prost_build runs the protobuf compiler (protoc)" in msg
    assert "stage 'build'" in msg and "protobuf-compiler" in msg and "build-apt.txt" in exc.value.hint
    # installed below the stage (pinned by prefetch like every deb): fine
    lock["apt"]["tools"]["files"].append({"name": "protobuf-compiler", "version": "3.21.12-3", "filename": "p.deb"})
    assert check_rust_toolchain(defn, lock) == []
    # protox in the tree: nothing needed
    lock["apt"]["tools"]["files"].pop()
    lock["sources"]["APP"]["cargo"]["protoc"] = {"needed": False, "compiler": "protox", "build_scripts": ["x"]}
    assert check_rust_toolchain(defn, lock) == []
