"""Pure parts of prefetch: FetchContent parsing, submodule URLs, image.yaml ``sources:``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from imagebuild.core.errors import DefinitionError, OperationFailed
from imagebuild.definition import reader as d
from imagebuild.fetch.fetchcontent import merge, parse, wanted
from imagebuild.fetch.prefetch import resolve_submodule_url

FIXTURES = Path(__file__).parents[2] / "fixtures" / "project"

# Shapes seen in vLLM's CMake files (written here from scratch): an override branch with
# SOURCE_DIR, then the repository declaration; submodules as a list; bracket comments; a tag
# from a variable; a keyword-looking word inside a quoted string.
VLLM_LIKE = r'''
include(FetchContent)
# FetchContent_Declare(commented GIT_REPOSITORY nope)
#[[ FetchContent_Declare(bracketed GIT_REPOSITORY nope) ]]
if (DEFINED ENV{VLLM_CUTLASS_SRC_DIR})
  FetchContent_Declare(cutlass SOURCE_DIR $ENV{VLLM_CUTLASS_SRC_DIR})
else()
  FetchContent_Declare(
        cutlass
        GIT_REPOSITORY https://github.com/NVIDIA/cutlass.git
        # a comment between arguments (GIT_TAG wrong)
        GIT_TAG v4.4.2
        GIT_PROGRESS TRUE
        GIT_SHALLOW TRUE
  )
endif()
FetchContent_Declare(
  vllm-flash-attn
  GIT_REPOSITORY https://github.com/vllm-project/flash-attention.git
  GIT_TAG "${FLASH_ATTN_REVISION}"
  GIT_SUBMODULES "csrc/cutlass"
  BINARY_DIR ${CMAKE_BINARY_DIR}/vllm-flash-attn
)
fetchcontent_declare(deepgemm GIT_REPOSITORY "https://github.com/deepseek-ai/DeepGEMM.git"
                     GIT_TAG a6b593d2826719dcf4892609af7b84ee23aaf32a
                     GIT_SUBMODULES "third-party/cutlass;third-party/fmt")
message(STATUS "FetchContent_Declare(not a call)")
'''


def test_parse_vllm_like_declarations():
    decls = merge(parse(VLLM_LIKE, "CMakeLists.txt"))
    assert set(decls) == {"cutlass", "vllm-flash-attn", "deepgemm"}
    c = decls["cutlass"]
    assert (c.repository, c.tag, c.line, c.lines) == ("https://github.com/NVIDIA/cutlass.git", "v4.4.2", 8, [6, 8])
    assert c.submodules is None  # not given: FetchContent would take them all
    fa = decls["vllm-flash-attn"]
    assert fa.tag == "${FLASH_ATTN_REVISION}" and fa.submodules == ["csrc/cutlass"] and fa.line == 17
    dg = decls["deepgemm"]
    assert dg.name == "deepgemm" and dg.submodules == ["third-party/cutlass", "third-party/fmt"]
    assert dg.tag == "a6b593d2826719dcf4892609af7b84ee23aaf32a" and dg.where == "CMakeLists.txt:24"


def test_parse_ignores_comments_and_strings():
    text = '# FetchContent_Declare(x GIT_REPOSITORY y)\nset(A "FetchContent_Declare(z)")\nFetchContent_Declare(ok)\n'
    assert [(x.name, x.line) for x in parse(text, "f")] == [("ok", 3)]


@pytest.mark.parametrize("path,ok", [
    ("CMakeLists.txt", True), ("cmake/external_projects/flashmla.cmake", True), ("cmake/utils.cmake", True),
    ("csrc/CMakeLists.txt", False), ("cmake/notes.txt", False), ("other/cmake/x.cmake", False)])
def test_scanned_files(path, ok):
    assert wanted(path) is ok


@pytest.mark.parametrize("parent,url,want", [
    ("git://h:9418/dep.git", "../sub.git", "git://h:9418/sub.git"),
    ("https://github.com/deepseek-ai/DeepGEMM.git", "../../NVIDIA/cutlass.git", "https://github.com/NVIDIA/cutlass.git"),
    ("git@github.com:org/repo.git", "../other.git", "git@github.com:org/other.git"),
    ("https://x/a/b.git", "./c.git", "https://x/a/b.git/c.git"),
    ("https://x/a.git", "https://elsewhere/y.git", "https://elsewhere/y.git"),
])
def test_submodule_urls(parent, url, want):
    assert resolve_submodule_url(parent, url) == want


def test_submodule_url_cannot_climb_above_host():
    with pytest.raises(OperationFailed):
        resolve_submodule_url("https://x/a.git", "../../../y.git")


def _project(tmp_path: Path, yaml_tail: str, env_tail: str = "") -> Path:
    root = tmp_path / "p"
    shutil.copytree(FIXTURES, root)
    img = root / "docker-images" / "tiny"
    sha = "0123456789abcdef0123456789abcdef01234567"
    (img / "versions.env").write_text((img / "versions.env").read_text() +
                                      f"CUTLASS_REPO=https://example.invalid/cutlass.git\nCUTLASS_REF={sha}\n"
                                      f"KERN_REPO=https://example.invalid/k.git\nKERN_REF=v3.5.1\n" + env_tail)
    (img / "image.yaml").write_text((img / "image.yaml").read_text() + yaml_tail)
    return root


def test_sources_mapping_defaults_and_values(tmp_path):
    root = _project(tmp_path, """sources:
  DEMO:
    scan_fetchcontent: true
  CUTLASS:
    dependency_of: DEMO
    env: VLLM_CUTLASS_SRC_DIR
  KERN:
    dependency_of: DEMO
    declares: triton_kernels
    subdir: python/triton_kernels/triton_kernels
    submodules: false
""")
    defn = d.load(root, "tiny")
    o = defn.source_options
    assert o["DEMO"].scan_fetchcontent and o["DEMO"].dependency_of is None and o["DEMO"].env is None
    assert (o["CUTLASS"].dependency_of, o["CUTLASS"].declares, o["CUTLASS"].env, o["CUTLASS"].scan_fetchcontent) \
        == ("DEMO", "cutlass", "VLLM_CUTLASS_SRC_DIR", False)
    assert o["KERN"].subdir == "python/triton_kernels/triton_kernels" and o["KERN"].declares == "triton_kernels"
    # no env: prefetch takes the override the tree reads (its SOURCE_DIR branch, else FetchContent's own)
    assert o["KERN"].env is None and o["KERN"].submodules is False


def test_sources_mapping_errors_name_line_and_key(tmp_path):
    root = _project(tmp_path, """sources:
  NOPE: {}
  CUTLASS:
    dependency_of: MISSING
    subdir: ../escape
    submodule: true
    env: "bad name"
  KERN:
    dependency_of: KERN
""")
    with pytest.raises(DefinitionError) as ei:
        d.load(root, "tiny")
    text = ei.value.render()
    line = (root / "docker-images/tiny/image.yaml").read_text().splitlines().index("  NOPE: {}") + 1
    assert f"image.yaml:{line}: sources.NOPE: unknown git source 'NOPE'" in text
    assert "sources.CUTLASS.dependency_of" in text and "'MISSING'" in text
    assert "sources.CUTLASS.subdir" in text and "unknown key 'submodule' in sources.CUTLASS" in text
    assert "did you mean 'submodules'?" in text and "sources.CUTLASS.env" in text
    assert "sources.KERN.dependency_of: a source cannot be a dependency of itself" in text


def test_sources_cycle(tmp_path):
    root = _project(tmp_path, "sources:\n  CUTLASS: {dependency_of: KERN}\n  KERN: {dependency_of: CUTLASS}\n")
    with pytest.raises(DefinitionError) as ei:
        d.load(root, "tiny")
    assert ei.value.render().count("forms a cycle") == 1


def test_old_git_is_refused_with_a_hint():
    from imagebuild.fetch.compose import check_git_version

    check_git_version("git version 2.43.0")
    with pytest.raises(OperationFailed) as ei:
        check_git_version("git version 2.34.1")
    assert "needs git >= 2.38" in ei.value.message and ei.value.hint
