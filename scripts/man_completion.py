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


def man(out: Path) -> Path:
    from argparse_manpage.manpage import Manpage

    from imagebuild import __version__
    from imagebuild.cli.main import build_parser

    page = Manpage(build_parser())
    page.source = f"imagebuild {__version__}"
    page.manual = "imagebuild manual"
    dest = out / "man" / "imagebuild.1"
    _atomic_write(dest, str(page))
    return dest


def completion(out: Path) -> list[Path]:
    import shtab

    from imagebuild.cli.main import build_parser

    done = []
    for shell, name in (("bash", "imagebuild.bash"), ("zsh", "_imagebuild")):
        dest = out / "completion" / name
        _atomic_write(dest, shtab.complete(build_parser(), shell=shell))
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
