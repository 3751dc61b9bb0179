"""``make man completion``: the man page (argparse-manpage) and the bash and zsh completions (shtab),
generated from imagebuild's own parser at build time, never committed (they would drift from it).

    python scripts/man_completion.py man [--out build]          -> build/man/imagebuild.1
    python scripts/man_completion.py completion [--out build]   -> build/completion/imagebuild.bash, _imagebuild
    python scripts/man_completion.py requirements               -> the 'man' extra of pyproject.toml

Needs the 'man' extra (pip install '.[man]'); the man page's date is $SOURCE_DATE_EPOCH's when set.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


NAME_LINE = "reproducible, offline, staged builds of vLLM serving images for DGX Spark clusters"


def _roff(text: str) -> str:
    """Plain text for a man page line: a leading dot or quote would be a request; hyphens are minus."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text[:1] in ".'" else text


def man(out: Path) -> Path:
    """The page: NAME with a line (whatis finds it), the commands and their options (from the parser),
    then EXIT STATUS, ENVIRONMENT (every variable, from ops/settings.py), EXAMPLES (each command's,
    as its --help ends) and SEE ALSO, as sections of their own, with no path of this build tree."""
    from argparse_manpage.manpage import Manpage

    from imagebuild import __version__
    from imagebuild.cli import parser as cli
    from imagebuild.ops.settings import VARIABLES

    top = cli.build_parser()
    top.epilog = None  # its exit codes, environment and docs path: the sections below
    page = Manpage(top)
    page.source = f"imagebuild {__version__}"
    page.manual = "imagebuild manual"
    page.description = NAME_LINE
    tp = lambda head, body: f".TP\n{head}\n{_roff(body)}\n"  # noqa: E731
    page.add_section("exit status", ">", "".join(tp(f"\\fB{code}\\fR", what) for code, what in cli.EXIT_CODES))
    page.add_section("environment", ">", "".join(tp(f"\\fB{_roff(name)}\\fR", what) for name, what in VARIABLES))
    examples = []
    examples_of = cli.examples()
    for name in cli.command_parsers(top):
        lines = examples_of.get(name, ())
        if lines:
            examples.append(f".SS imagebuild {_roff(name)}\n.nf\n" + "\n".join(_roff(e) for e in lines) + "\n.fi\n")
    page.add_section("examples", ">", "".join(examples))
    page.add_section("see also", ">", "The Markdown documentation installed with imagebuild "
                     "(share/doc/imagebuild under its prefix, or docs/ in a checkout): cli.md for every command, "
                     "image\\-definition.md, build.md, gate.md, nightly.md. "
                     "\\fBimagebuild help\\fR \\fICOMMAND\\fR prints one command's help.\n")
    dest = out / "man" / "imagebuild.1"
    _atomic_write(dest, str(page))
    return dest


# The words completed from the project around the command line: its images (docker-images/*/image.yaml)
# and its peers (imagebuild.yaml's peers:, and its peer_lists: as @NAME), read by the shell itself (no
# Python starts on a TAB). The project: --root DIR on the line, else $IMAGEBUILD_ROOT, else the nearest
# folder at or above the current one holding docker-images/, as imagebuild finds it.
WORDS = r"""
_imagebuild_words() {
  local d="${IMAGEBUILD_ROOT:-$PWD}" i f
  if [ -n "${COMP_WORDS+x}" ]; then
    for ((i = 1; i < ${#COMP_WORDS[@]}; i++)); do
      [ "${COMP_WORDS[i-1]}" = --root ] && d="${COMP_WORDS[i]}"
    done
  fi
  while [ "$d" != / ] && [ -n "$d" ] && [ ! -d "$d/docker-images" ]; do d=$(dirname "$d"); done
  [ -d "$d/docker-images" ] || return 0
  case "$1" in
    images)
      for f in "$d"/docker-images/*/image.yaml; do
        [ -f "$f" ] || continue
        f="${f%/image.yaml}"; printf '%s\n' "${f##*/}"
      done ;;
    peers)
      [ -f "$d/imagebuild.yaml" ] || return 0
      awk '
        function out(w) { gsub(/["\047 \t]/, "", w); if (w != "") print w }
        /^peers:/ { s = $0; sub(/^peers:[ \t]*/, "", s); sub(/[ \t]*#.*$/, "", s); blk = 0; lst = 0
                    if (s ~ /^\[/) { gsub(/[][]/, "", s); n = split(s, a, ","); for (i = 1; i <= n; i++) out(a[i]) }
                    else blk = 1; next }
        /^peer_lists:/ { lst = 1; blk = 0; next }
        /^[^ \t#-]/ { blk = 0; lst = 0 }
        blk && /^[ \t]*-/ { s = $0; sub(/^[ \t]*-[ \t]*/, "", s); sub(/[ \t]*#.*$/, "", s); out(s) }
        lst && /^[ \t]+[A-Za-z0-9_.-]+[ \t]*:/ { s = $0; sub(/^[ \t]+/, "", s); sub(/[ \t]*:.*/, "", s); out("@" s) }
      ' "$d/imagebuild.yaml" ;;
  esac
}
"""
BASH = WORDS + r"""
_imagebuild_images() { compgen -W "$(_imagebuild_words images)" -- "$1"; }
_imagebuild_peers() { compgen -W "$(_imagebuild_words peers)" -- "$1"; }
"""
ZSH = WORDS + r"""
_imagebuild_images() { local -a w; w=(${(f)"$(_imagebuild_words images)"}); _describe image w; }
_imagebuild_peers() { local -a w; w=(${(f)"$(_imagebuild_words peers)"}); _describe peer w; }
"""
IMAGES = {"bash": "_imagebuild_images", "zsh": "_imagebuild_images"}
PEERS = {"bash": "_imagebuild_peers", "zsh": "_imagebuild_peers"}


def _completing_parser():
    """The parser, with what each argument completes to: IMAGE arguments the project's images, PEER
    arguments its peers, ``help COMMAND`` the command names."""
    from imagebuild.cli.parser import build_parser, command_parsers

    parser = build_parser()
    commands = command_parsers(parser)
    for name, sp in commands.items():
        for a in sp._actions:
            meta = str(a.metavar or "")
            if a.dest in ("peer", "peers") or meta.startswith("PEER") or meta == "HOST":
                a.complete = PEERS
            elif meta.startswith(("IMAGE", "[IMAGE]")) or (not a.option_strings and a.dest in ("image", "images")):
                a.complete = IMAGES
            elif name == "help" and not a.option_strings:
                a.choices = sorted(commands)
    return parser


def completion(out: Path) -> list[Path]:
    import shtab

    done = []
    for shell, name, preamble in (("bash", "imagebuild.bash", BASH), ("zsh", "_imagebuild", ZSH)):
        dest = out / "completion" / name
        _atomic_write(dest, shtab.complete(_completing_parser(), shell=shell, preamble=preamble))
        done.append(dest)
    return done


def requirements() -> list[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return data["project"]["optional-dependencies"]["man"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("man", "completion", "requirements"))
    p.add_argument("--out", default=str(ROOT / "build"), help="output folder (default build/)")
    args = p.parse_args(argv)
    if args.what == "requirements":
        print(" ".join(requirements()))
        return 0
    try:
        made = [man(Path(args.out))] if args.what == "man" else completion(Path(args.out))
    except ImportError as exc:
        print(f"error: {exc.name} is missing: pip install {' '.join(repr(r) for r in requirements())}",
              file=sys.stderr)
        return 2
    for path in made:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
