import subprocess
from pathlib import Path

import pytest

from imagebuild.core.errors import DefinitionError
from imagebuild.definition import envfile

GOOD = """\
# comment
A=plain
B="two words"   # trailing comment
C='single $quoted'

D=
E=x#y
"""


def test_parses_and_matches_bash(tmp_path):
    p = tmp_path / "versions.env"
    p.write_text(GOOD)
    env = envfile.load(p, "versions.env")
    assert env.values() == {"A": "plain", "B": "two words", "C": "single $quoted", "D": "", "E": "x#y"}
    assert env.line_of("B") == 3
    # bash reads the same values
    out = subprocess.run(["bash", "-c", f"set -e; source {p}; printf '%s|' \"$A\" \"$B\" \"$C\" \"$D\" \"$E\""],
                         capture_output=True, text=True, check=True).stdout
    assert out == "plain|two words|single $quoted||x#y|"


@pytest.mark.parametrize("line, needle", [
    ("A = b", "spaces around"),
    ("A=$(rm -rf /)", "interpret"),
    ('A="$HOME"', "expanded"),
    ("A=two words", "unexpected text"),
    ("lower=x", "invalid key"),
    ("export A=x", "export"),
    ("A='unterminated", "unterminated"),
    ("just text", "expected KEY=VALUE"),
])
def test_bad_lines(tmp_path, line, needle):
    p = tmp_path / "versions.env"
    p.write_text(f"# header\n{line}\n")
    with pytest.raises(DefinitionError) as ei:
        envfile.load(p, "versions.env")
    (prob,) = ei.value.problems
    assert needle in prob.message
    assert prob.line == 2


def test_all_problems_reported(tmp_path):
    p = tmp_path / "versions.env"
    p.write_text("A = 1\nB=ok\nB=dup\nc=1\n")
    with pytest.raises(DefinitionError) as ei:
        envfile.load(p, "versions.env")
    assert [pr.line for pr in ei.value.problems] == [1, 3, 4]


def test_update_in_place_keeps_comments_and_order(tmp_path):
    p = tmp_path / "versions.env"
    p.write_text("# top\nVLLM_PRS=550  # the fork's PRs\nOTHER=1\n")
    env = envfile.load(p, "versions.env")
    env.update({"VLLM_PRS": "550@" + "a" * 40 + " 552@" + "b" * 40, "NEW_KEY": "v"})
    text = p.read_text()
    assert text.splitlines()[0] == "# top"
    assert text.splitlines()[1] == f'VLLM_PRS="550@{"a" * 40} 552@{"b" * 40}"  # the fork\'s PRs'
    assert text.splitlines()[2] == "OTHER=1"
    assert text.rstrip().endswith("NEW_KEY=v")
    again = envfile.load(p, "versions.env")
    assert again.get("VLLM_PRS").startswith("550@")
    assert not list(Path(tmp_path).glob("*.tmp"))


def test_quote_refuses_unsafe_values():
    assert envfile.quote("abc") == "abc"
    assert envfile.quote("a b") == '"a b"'
    assert envfile.quote("$x y") == "'$x y'"
    with pytest.raises(ValueError):
        envfile.quote("it's $x")
