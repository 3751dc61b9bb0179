"""The cuda-targets rule on real cuobjdump listings (tests/fixtures/cuobjdump/README.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from imagebuild.gate import cuda_targets as ct

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "cuobjdump"
MIXED = (FIX / "sm121a-sm120f.resource-usage.txt").read_text()
PTX = (FIX / "sm121a-ptx.txt").read_text()


def _framed(*files: tuple[str, str, int]) -> str:
    return "".join(f"\n{ct.FRAME}{path}\n{text}\n{ct.RC}{rc}\n" for path, text, rc in files)


def test_listings_parse_to_their_targets_and_kernels():
    mixed = ct.parse_listing(MIXED)
    assert mixed.sass == {"sm_121a", "sm_120f"} and mixed.ptx == set()
    assert mixed.kernels == {"_Z4axpyfPKfPfi"}
    ptx = ct.parse_listing(PTX)
    assert ptx.sass == {"sm_121a"} and ptx.ptx == {"compute_121a"} and ptx.kernels == set()


def test_scan_sorts_cuda_plain_and_unreadable_files():
    scan = ct.parse_scan(_framed(
        ("/v/_C.so", MIXED, 0),
        ("/v/libz.so", "cuobjdump info    : File '/v/libz.so' does not contain device code", 255),
        ("/v/bad.so", "cuobjdump fatal   : Invalid fatbin header in '/v/bad.so'", 1)))
    assert set(scan.cuda) == {"/v/_C.so"} and scan.plain == ["/v/libz.so"]
    assert scan.unreadable == {"/v/bad.so": "cuobjdump fatal   : Invalid fatbin header in '/v/bad.so'"}


def _judge(scan, **kw):
    args = {"sass": ["sm_121a"], "ptx": [], "require": ["sm_121a"], "kernels": [], "min_files": 1} | kw
    return ct.judge(scan, **args)


def test_rule_each_part_can_fail():
    mixed = ct.parse_scan(_framed(("/v/a.so", MIXED, 0)))
    ok, detail = _judge(mixed, sass=["sm_121a", "sm_120f"])
    assert ok and detail == "1 CUDA ELF(s), 0 without device code; SASS sm_120f, sm_121a; PTX none"
    # a target the rule does not allow
    ok, detail = _judge(mixed)
    assert not ok and "unexpected target sm_120f in 1 file(s), e.g. /v/a.so" in detail
    # PTX is refused unless listed
    ptx = ct.parse_scan(_framed(("/v/p.so", PTX, 0)))
    assert not _judge(ptx)[0] and "unexpected target compute_121a" in _judge(ptx)[1]
    assert _judge(ptx, ptx=["compute_121a"])[0]
    # a file with SASS for none of the allowed targets
    only120 = ct.parse_scan(_framed(("/v/o.so", MIXED.replace("sm_121a", "sm_120f"), 0)))
    ok, detail = _judge(only120, sass=["sm_121a", "sm_120f"], require=["sm_120f"])
    assert ok, detail
    ok, detail = _judge(only120, sass=["sm_121a", "sm_120f"])
    assert not ok and "required target sm_121a is in no file" in detail
    ok, detail = _judge(ct.parse_scan(_framed(("/v/o.so", PTX.split("Fatbin ptx")[0].replace("sm_121a", "sm_90"), 0))),
                        sass=["sm_121a"], require=[])
    assert not ok and "carry no SASS for sm_121a" in detail
    # kernels: a pattern no kernel matches
    ok, detail = _judge(mixed, sass=["sm_121a", "sm_120f"], kernels=["axpy", "cvt_fp16_to_fp4"])
    assert not ok and "no kernel matches /cvt_fp16_to_fp4/ (of 1 kernels)" in detail
    # too few files, and unreadable ones
    ok, detail = _judge(ct.parse_scan(_framed(("/v/l.so", "does not contain device code", 255))))
    assert not ok and "found 0 CUDA ELF(s), expected at least 1" in detail
    bad = ct.parse_scan(_framed(("/v/a.so", MIXED, 0), ("/v/b.so", "cuobjdump fatal : x", 1)))
    ok, detail = _judge(bad, sass=["sm_121a", "sm_120f"])
    assert not ok and "cuobjdump cannot read 1 file(s), e.g. /v/b.so" in detail


def test_tolerated_targets_sit_beside_a_files_own_never_instead_of_them():
    mixed = ct.parse_scan(_framed(("/v/a.so", MIXED, 0)))  # sm_121a + sm_120f
    ok, detail = _judge(mixed, tolerate=["sm_120f"])
    assert ok, detail
    only120 = ct.parse_scan(_framed(("/v/o.so", MIXED.replace("sm_121a", "sm_120f"), 0)))
    ok, detail = _judge(only120, tolerate=["sm_120f"], require=[])
    assert not ok and "carry no SASS for sm_121a" in detail and "tolerated: sm_120f" in detail
    ptx = ct.parse_scan(_framed(("/v/p.so", PTX, 0)))  # sm_121a + compute_121a
    assert _judge(ptx, tolerate=["compute_121a"])[0]


@pytest.mark.parametrize("target, ok", [("sm_121a", True), ("sm_121f", True), ("sm_90", True),
                                        ("sm_1210", False), ("compute_121a", False), ("121a", False)])
def test_sass_target_names(target, ok):
    assert bool(ct.SASS_RE.match(target)) is ok


# --- per-library lists and the node's driver (PTX ISA) ----------------------------------------------

FA2_LIST = (FIX / "fa2-sm80-ptx.txt").read_text()
FA2_PTX_90 = (FIX / "fa2-sm80-ptx-nvcc13.0.ptx.txt").read_text()
FA2_PTX_92 = (FIX / "fa2-sm80-ptx-nvcc13.2.ptx.txt").read_text()
FA2_LIB = {"files": "vllm_flash_attn/_vllm_fa2_C*.so", "targets": ["sm_80", "compute_80"], "why": "CMakeLists.txt:140",
           "min_files": 0}
R580 = {"name": "R580", "cuda": "13.0", "ptx_isa": "9.0"}


def test_ptx_text_gives_each_ptx_its_isa_version():
    assert ct.parse_ptx_versions(FA2_PTX_90) == {("compute_80", "9.0")}
    assert ct.parse_ptx_versions(FA2_PTX_92) == {("compute_80", "9.2")}
    # what the check keeps of it in the image (grep -E PTX_KEEP) parses the same
    kept = "\n".join(ln for ln in FA2_PTX_92.splitlines() if re.match(ct.PTX_KEEP, ln))
    assert ct.parse_ptx_versions(kept) == {("compute_80", "9.2")}


def _fa2_scan(ptx_text: str | None, *, with_c: bool = True):
    fa2 = "/v/vllm_flash_attn/_vllm_fa2_C.abi3.so"
    scan = ct.parse_scan(_framed(*([("/v/_C.so", PTX, 0)] if with_c else []), (fa2, FA2_LIST, 0)))
    if ptx_text is not None:
        ct.add_ptx_versions(scan, _framed((fa2, ptx_text, 0), ("/v/_C.so", "", 0)))
    return scan


def test_a_library_is_judged_by_its_own_list_not_the_images():
    # without `libraries`, FA2's sm_80 + compute_80 is "no SASS for sm_121a" (the issue's finding)
    ok, detail = _judge(_fa2_scan(None), ptx=["compute_121a"])
    assert not ok and "1 file(s) carry no SASS for sm_121a, e.g. /v/vllm_flash_attn/_vllm_fa2_C.abi3.so" in detail
    ok, detail = _judge(_fa2_scan(None), ptx=["compute_121a"], libraries=[FA2_LIB], root="/v")
    assert ok, detail
    assert "vllm_flash_attn/_vllm_fa2_C*.so: 1 file(s), sm_80+compute_80 as its build asks" in detail


def test_a_library_must_carry_exactly_its_list():
    short = dict(FA2_LIB, targets=["sm_80", "compute_80", "sm_90"])
    ok, detail = _judge(_fa2_scan(None), ptx=["compute_121a"], libraries=[short], root="/v")
    assert not ok and ("/v/vllm_flash_attn/_vllm_fa2_C.abi3.so lacks sm_90 (its build asks for sm_80, "
                       "compute_80, sm_90)") in detail
    narrow = dict(FA2_LIB, targets=["sm_80"])
    ok, detail = _judge(_fa2_scan(None), ptx=["compute_121a"], libraries=[narrow], root="/v")
    assert not ok and "unexpected target compute_80 in 1 file(s), e.g. /v/vllm_flash_attn/_vllm_fa2_C.abi3.so" in detail
    needed = dict(FA2_LIB, min_files=1)
    ok, detail = _judge(_fa2_scan(None, with_c=True), ptx=["compute_121a"], libraries=[dict(needed, files="x/*.so")],
                        root="/v")
    assert not ok and "library x/*.so: found 0 CUDA ELF(s), expected at least 1" in detail


def test_ptx_newer_than_the_driver_takes_is_refused_naming_file_and_both_versions():
    kw = {"ptx": ["compute_121a"], "libraries": [FA2_LIB], "root": "/v", "driver": R580}
    ok, detail = _judge(_fa2_scan(FA2_PTX_90), **kw)
    assert not ok and "carry PTX whose ISA version could not be read, e.g. /v/_C.so" in detail  # _C's read gave none
    ok, detail = _judge(_fa2_scan(FA2_PTX_90, with_c=False), **kw | {"require": []})
    assert ok, detail
    assert detail.endswith("PTX ISA 9.0, driver R580 (CUDA 13.0) takes up to 9.0")
    ok, detail = _judge(_fa2_scan(FA2_PTX_92, with_c=False), **kw | {"require": []})
    assert not ok
    assert ("1 PTX image(s) that driver R580 (CUDA 13.0) cannot JIT, as it takes PTX ISA up to 9.0: "
            "/v/vllm_flash_attn/_vllm_fa2_C.abi3.so (compute_80) is PTX ISA 9.2") in detail
    # PTX whose version was not read is not passed
    ok, detail = _judge(_fa2_scan(None, with_c=False), **kw | {"require": []})
    assert not ok and "1 file(s) carry PTX whose ISA version could not be read" in detail


def test_a_failed_ptx_extraction_is_unreadable():
    scan = _fa2_scan(None, with_c=False)
    fa2 = "/v/vllm_flash_attn/_vllm_fa2_C.abi3.so"
    ct.add_ptx_versions(scan, _framed((fa2, "cuobjdump fatal   : out of memory", 1)))
    ok, detail = _judge(scan, ptx=["compute_121a"], libraries=[FA2_LIB], root="/v", driver=R580, require=[])
    assert not ok and "cuobjdump -ptx: cuobjdump fatal   : out of memory" in detail
