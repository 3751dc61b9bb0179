"""Flags that no longer swallow positionals, one meaning of -j, and the examples of every command's
help parse (issue 23, section 4)."""

from __future__ import annotations

import shlex

import pytest

from imagebuild.cli import parser as cli
from imagebuild.cli.commands import nightly as cli_nightly
from imagebuild.core.errors import UsageError
from imagebuild.core.units import human_bytes, short_digest


def parse(*argv: str):
    return cli.parse(cli.build_parser(only=cli.command_in(list(argv))), list(argv))


@pytest.mark.parametrize("argv, images, peers", [
    (["nightly", "--peer", "dgx4", "example"], ["example"], ("dgx4",)),
    (["nightly", "--peer", "dgx4", "--peer", "ops@dgx5", "a", "b"], ["a", "b"], ("dgx4", "ops@dgx5")),
    (["nightly", "--peer", "dgx4,dgx5", "example"], ["example"], ("dgx4", "dgx5")),
    (["nightly", "--no-peers", "example"], ["example"], ()),
    (["nightly", "example"], ["example"], ("from-yaml",)),
    # the old spelling still works (one value, or none), and no longer takes the image for a peer
    (["nightly", "--peers", "dgx4", "example"], ["example"], ("dgx4",)),
    (["nightly", "example", "--peers"], ["example"], ()),
    (["nightly", "--peers", "dgx4,dgx5", "example"], ["example"], ("dgx4", "dgx5")),
])
def test_nightly_peers(argv, images, peers, capsys):
    args = parse(*argv)
    assert args.images == images
    assert cli_nightly._peers(args, ("from-yaml",)) == peers
    err = capsys.readouterr().err
    assert ("--peers is deprecated" in err) == ("--peers" in argv)


def test_nightly_no_peers_and_peer_conflict():
    with pytest.raises(UsageError):
        cli_nightly._peers(parse("nightly", "--no-peers", "--peer", "x", "example"), ())


@pytest.mark.parametrize("argv, images, refresh, named", [
    (["prefetch", "--refresh", "example"], ["example"], True, []),
    (["prefetch", "example", "--refresh"], ["example"], True, []),
    (["prefetch", "--refresh-source", "VLLM", "--refresh-source", "DEP", "example"], ["example"], False, ["VLLM", "DEP"]),
    (["prefetch", "--refresh=VLLM", "example"], ["example"], False, ["VLLM"]),
    (["prefetch", "example"], ["example"], False, []),
])
def test_prefetch_refresh(argv, images, refresh, named):
    args = parse(*argv)
    assert args.images == images and args.refresh is refresh and args.refresh_source == named


def test_j_means_build_jobs(capsys):
    assert parse("build", "example", "-j", "3").jobs == 3
    assert capsys.readouterr().err == ""
    # elsewhere -j still works for now, with a warning that names the option to use
    assert parse("prefetch", "-j", "2").jobs == 2
    assert "-j is deprecated here: use --jobs" in capsys.readouterr().err
    assert parse("sync", "-j", "2", "dgx4").jobs == 2 and parse("sync", "dgx4").jobs == 4
    assert "-j is deprecated here" in capsys.readouterr().err
    assert parse("prefetch", "--jobs", "2").jobs == 2 and parse("prefetch").jobs == 4
    import re

    for name in ("prefetch", "sync"):  # the help lists -j only for build
        assert not re.search(r"(?<!-)-j\b", cli.command_parsers(cli.build_parser())[name].format_help()), name
    assert "-j N" in cli.command_parsers(cli.build_parser())["build"].format_help()


def test_log_limit_and_dry_runs_parse():
    assert parse("log", "-n", "5").limit == 5 and parse("log", "example", "--limit", "2").limit == 2
    assert parse("rollback", "example", "--dry-run").dry_run is True
    assert parse("prefetch", "example", "--dry-run").dry_run is True


@pytest.mark.parametrize("name", sorted(cli.examples()))
def test_every_example_parses(name):
    for example in cli.examples()[name]:
        words = shlex.split(example)
        while "=" in words[0]:  # VAR=value prefixes
            words.pop(0)
        assert words[0] == "imagebuild" and words[1] == name, example
        args = parse(*words[1:])
        assert args.command == name, example


def test_one_unit_system_and_short_digests():
    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 KiB"
    assert human_bytes(235.8 * 2 ** 20) == "235.8 MiB" and human_bytes(3 * 2 ** 40) == "3.0 TiB"
    assert short_digest("sha256:" + "ab" * 32) == "sha256:" + "ab" * 6
    assert short_digest(None) == "-" and short_digest("0123456789abcdef") == "0123456789ab"


def test_no_decimal_units_in_human_output():
    """MB/GB formatting (powers of 1000) is gone from what imagebuild prints: one unit system."""
    import re
    from pathlib import Path

    pkg = Path(cli.__file__).resolve().parents[1]
    bad = []
    for f in sorted(pkg.rglob("*.py")):
        for n, line in enumerate(f.read_text().splitlines(), start=1):
            code = line.split("#", 1)[0]
            if re.search(r"/ 1e[369]\b.*\b[kMGT]B\b|\"[kMGT]B\"\)|\(\"B\", \"kB\"", code):
                bad.append(f"{f.relative_to(pkg)}:{n}: {line.strip()}")
    assert bad == []


def test_the_old_refresh_names_still_work(project):
    from tests.conftest import run_cli

    res = run_cli("--root", str(project), "prefetch", "--refresh", "DEMO", "tiny", "--offline")
    assert "taken as --refresh-source DEMO" in res.err and "invalid image name" not in res.err
    assert res.code == 2 and "--refresh needs the network" in res.err
