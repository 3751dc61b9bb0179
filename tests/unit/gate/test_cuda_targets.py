"""The cuda-targets rule on real cuobjdump listings (tests/fixtures/cuobjdump/README.md)."""

from __future__ import annotations

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
