"""Command line: argument parsing and output only. ``main(argv) -> exit code``.

Conventions (docs/cli.md): data on stdout, progress and logs on stderr, ``--json`` where the
output is data, documented exit codes, no traceback unless ``--debug``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from imagebuild import __version__
from imagebuild.cli import common
from imagebuild.core import interrupts, lazy
from imagebuild.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_GATE_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
    DefinitionError,
    GateFailed,
    ImagebuildError,
    UsageError,
    shown,
)
from imagebuild.core.printable import printable
from imagebuild.core.units import human_bytes, short_digest

defn_mod = lazy.module("imagebuild.definition.reader")
doctor_mod = lazy.module("imagebuild.ops.doctor")
engine_mod = lazy.module("imagebuild.core.engine")
plan_mod = lazy.module("imagebuild.plan.planner")
json = lazy.module("json")
traceback = lazy.module("traceback")
log = lazy.logger()


def _docs_dir() -> str:
    """Where the Markdown docs are: the checkout's docs/ when running from one, else where pip or pipx
    installed them (<prefix>/share/doc/imagebuild, pyproject.toml's data-files)."""
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    here = os.path.join(top, "docs")
    if os.path.isfile(os.path.join(here, "cli.md")):
        return here
    return os.path.join(sys.prefix, "share", "doc", "imagebuild")


# the exit codes, as the top-level help and the man page's EXIT STATUS say them (docs/cli.md has the table)
EXIT_CODES = (
    (EXIT_OK, "success"),
    (EXIT_FAILED, "an operation failed (docker, git, network, a failed check in doctor)"),
    (EXIT_BAD_INPUT, "bad input or configuration (definition errors, bad flags)"),
    (EXIT_REFUSED, "refused by a guard rail (serving container running, wrong architecture, lock held)"),
    (EXIT_GATE_FAILED, "the image's gate failed"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)

EPILOG = "exit codes:\n" + "".join(f"  {code:<5}{what}\n" for code, what in EXIT_CODES) + f"""
environment:
  IMAGEBUILD_ROOT   project root (folder holding docker-images/); default: nearest one above the
                    current folder
  NO_COLOR          no colour in output
  all the variables read, with what each does: imagebuild config --env

With no command: this help, exit 2. Each command's options and examples: imagebuild help COMMAND
(or COMMAND --help).

docs: {_docs_dir()}/ (cli.md: every command; image-definition.md, build.md, gate.md, nightly.md, ...);
the man page (make man before the install): man imagebuild
"""

# The commands in the top-level help, by step (a command no group names is listed under "other")
GROUPS = (
    ("define and inspect", ("list", "validate", "plan", "config")),
    ("fetch", ("prefetch", "bundle", "unbundle")),
    ("build and check", ("build", "gate", "shell", "patch", "log")),
    ("ship", ("sync", "rollback")),
    ("operate", ("nightly", "report", "diff", "df", "gc", "doctor")),
    ("help", ("help",)),
)

# Two or three examples per command: the end of its --help (the exit codes and the environment are in
# the top-level help only)
EXAMPLES = {
    "list": ("imagebuild list", "imagebuild list --json"),
    "validate": ("imagebuild validate", "imagebuild validate glm53-jovian-r12 --json"),
    "plan": ("imagebuild plan example", "imagebuild plan example --no-engine --json"),
    "config": ("imagebuild config", "imagebuild config --env", "IMAGEBUILD_STAGES=/srv/stages imagebuild config --json"),
    "prefetch": ("imagebuild prefetch example", "imagebuild prefetch example --refresh-source VLLM --dry-run",
                 "imagebuild prefetch --offline"),
    "bundle": ("imagebuild bundle example -o example.bundle.tar",
               "imagebuild bundle example -o /media/usb/example.tar --json"),
    "unbundle": ("imagebuild unbundle example.bundle.tar", "imagebuild unbundle example.bundle.tar --json"),
    "build": ("imagebuild build example", "imagebuild build example --dry-run",
              "imagebuild build example --until wheel --no-gate"),
    "gate": ("imagebuild gate example", "imagebuild gate example --check-receipt",
             "imagebuild gate some/image:tag --spec gate.yaml --junit gate.xml"),
    "patch": ("imagebuild patch glm53-jovian-r12 --src ~/src/vllm --check",
              "imagebuild patch glm53-jovian-r12 --src ~/src/vllm --stage vllm-wheel"),
    "shell": ("imagebuild shell example app", "imagebuild shell example app -- ls /imagebuild/context"),
    "log": ("imagebuild log", "imagebuild log example latest", "imagebuild log example latest --stage base"),
    "sync": ("imagebuild sync dgx4", "imagebuild sync --image example --dry-run dgx4 dgx5",
             "imagebuild sync @rack2 --via registry"),
    "rollback": ("imagebuild rollback example", "imagebuild rollback example --dry-run",
                 "imagebuild rollback example --registry"),
    "nightly": ("imagebuild nightly example", "imagebuild nightly --refresh --peer dgx4 example",
                "imagebuild nightly --no-peers --no-gc example"),
    "report": ("imagebuild report", "imagebuild report example --summary", "imagebuild report latest --json"),
    "diff": ("imagebuild diff example:previous example:local", "imagebuild diff example:previous example:local --json"),
    "df": ("imagebuild df", "imagebuild df --all", "imagebuild df example --json"),
    "gc": ("imagebuild gc --dry-run", "imagebuild gc example --keep 1", "imagebuild gc --peer dgx4 --dry-run"),
    "doctor": ("imagebuild doctor", "imagebuild doctor --peer dgx4 --json"),
    "help": ("imagebuild help", "imagebuild help build"),
}
SHORT_EPILOG = "exit codes, environment variables, docs: imagebuild --help"


def _command_epilog(name: str, epilog: str | None) -> str | None:
    """A command's epilog: its examples, then what it adds to EPILOG, then a pointer to the top-level
    help (which alone carries EPILOG)."""
    if epilog is None or not epilog.startswith(EPILOG):
        return epilog
    examples = EXAMPLES.get(name, ())
    parts = ["examples:\n" + "\n".join(f"  {e}" for e in examples)] if examples else []
    extra = epilog[len(EPILOG):].strip("\n")
    return "\n\n".join([*parts, *([extra] if extra else []), SHORT_EPILOG]) + "\n"


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs: each line that does not start with a space is wrapped to the terminal's
    width; indented lines (examples, tables) are kept as written."""

    def _fill_text(self, text, width, indent):
        import textwrap

        return "".join(line + "\n" if not line or line[0] == " " else
                       textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent) + "\n"
                       for line in text.splitlines())


class _TopFormatter(_Formatter):
    """The top-level help: the commands grouped by step (GROUPS), each with its one-line help."""

    def _format_action(self, action):
        if not isinstance(action, argparse._SubParsersAction):
            return super()._format_action(action)
        import textwrap

        helps = {a.dest: a.help or "" for a in action._get_subactions()}
        grouped = [(title, [n for n in names if n in helps]) for title, names in GROUPS]
        rest = [n for n in helps if not any(n in names for _, names in GROUPS)]
        if rest:
            grouped.append(("other", rest))
        w = max(len(n) for n in helps) + 2
        out = []
        for title, names in grouped:
            if not names:
                continue
            out.append(f"  {title}:\n")
            for n in names:
                lines = textwrap.wrap(helps[n], max(30, self._width - w - 6)) or [""]
                out.append(f"    {n:<{w}}{lines[0]}\n" + "".join(f"    {'':<{w}}{ln}\n" for ln in lines[1:]))
        return "".join(out)


class _Parser(argparse.ArgumentParser):
    """Exit 2 with usage on bad flags, as documented; options are never abbreviated (``--fo`` is not
    ``--force``); the global options work before and after the command."""

    def __init__(self, *args, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def _get_formatter(self):
        # argparse asks shutil for the width (importing shutil, bz2, lzma: ~5 ms) on every add_argument
        return self.formatter_class(prog=self.prog, width=_terminal_width())

    def error(self, message: str):  # exit 2 with usage, as documented
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _terminal_width() -> int:
    """shutil.get_terminal_size().columns without importing shutil."""
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 80


def _global_options(p: argparse.ArgumentParser, *, after_command: bool = False) -> None:
    """--root, --debug, -v, -q: on the main parser, and again on every command's parser so that
    ``imagebuild plan X --debug`` works too. After the command they default to SUPPRESS: a value
    given before the command is then kept."""
    unset = {"default": argparse.SUPPRESS} if after_command else {}
    g = p.add_argument_group("global options (before or after the command)") if after_command else p
    g.add_argument("--root", metavar="DIR", **(unset or {"default": os.environ.get("IMAGEBUILD_ROOT")}),
                   help="project root holding docker-images/ (default: $IMAGEBUILD_ROOT, else the nearest "
                   "folder at or above the current one that has docker-images/)")
    g.add_argument("--debug", action="store_true", **unset,
                   help="show tracebacks and debug logs (every command run)")
    g.add_argument("-v", "--verbose", action="store_true", **unset,
                   help="more on stderr: every command run (+ docker ...) and, for build, each stage's log lines")
    g.add_argument("-q", "--quiet", action="store_true", **unset,
                   help="only warnings and errors on stderr (not with -v)")


class _DeprecatedOption(argparse.Action):
    """An old spelling that still works, with a warning on stderr naming the new one."""

    def __init__(self, option_strings, dest, use: str = "", **kw):
        self.use = use
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated here: use {self.use}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _deprecated(sp, *flags: str, dest: str, use: str, **kw) -> None:
    """Add ``flags`` as a hidden, deprecated spelling of option ``dest`` (the same type and value)."""
    sp.add_argument(*flags, dest=dest, action=_DeprecatedOption, use=use, default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS, **kw)


class _SubParsers(argparse._SubParsersAction):
    only: str | None = None  # build_parser(only=...): the other commands get a stand-in

    def add_parser(self, name, **kw):
        if self.only is not None and name != self.only:
            real, self._parser_class = self._parser_class, _Unused
            try:
                return super().add_parser(name, **kw)
            finally:
                self._parser_class = real
        if "epilog" in kw:
            kw["epilog"] = _command_epilog(name, kw["epilog"])
        if kw.get("formatter_class") is argparse.RawDescriptionHelpFormatter:
            kw["formatter_class"] = _Formatter
        sp = super().add_parser(name, **kw)
        _global_options(sp, after_command=True)
        return sp


class _Unused:
    """A command's parser when another command runs: its options are never parsed or shown, and
    building them costs start-up time (argparse looks up translations for every option)."""

    def __init__(self, **kw):
        pass

    def __getattr__(self, name):
        return lambda *a, **kw: self


def _command_in(argv: Sequence[str]) -> str:
    """The command named in ``argv`` (the first word that is not an option or --root's value), or
    "" when there is none (``--version``, ``--help``, a usage error: no command parser is needed)."""
    it = iter(argv)
    for word in it:
        if word == "--root":
            next(it, None)
        elif word in ("-h", "--help"):
            return ""
        elif not word.startswith("-"):
            return word
    return ""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, that command's options are built and the others' are not."""
    p = _Parser(
        prog="imagebuild",
        description="Reproducible, offline, staged builds of vLLM serving images for DGX Spark (GB10) "
        "clusters: definitions -> plan -> prefetch -> build -> gate -> promotion to IMAGE:local.",
        epilog=EPILOG, formatter_class=_TopFormatter)
    p.add_argument("--version", action="version", version=f"imagebuild {__version__}")
    _global_options(p)
    p.register("action", "parsers", _SubParsers)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, title="commands")
    sub.required = True
    sub.only = only

    sp = sub.add_parser("list", help="list the image definitions under docker-images/",
                        description="List the image definitions under docker-images/ with their platform, "
                        "stages and whether each one is valid. Reads only.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.list, version 1)")
    sp.set_defaults(func=cmd_list)

    sp = sub.add_parser("plan", help="show an image's stages, build args, inputs and cache keys",
                        description="Validate IMAGE's definition and print its build plan: the stages in "
                        "order, each with its Dockerfile, parent, build args and their values and origins, "
                        "input files with digests, and a content-addressed cache key. Has no side effects. "
                        "When a Docker engine answers, also says which stage images already exist.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("image", metavar="IMAGE", help="image name (a folder under docker-images/)")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.plan, version 2)")
    sp.add_argument("--no-engine", action="store_true",
                    help="do not ask the Docker engine which stage images exist")
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("validate", help="check image definitions and imagebuild.yaml and report every problem",
                        description="Check one or all image definitions, and the project's imagebuild.yaml, and "
                        "report every problem found (file, line or key, what was expected, a hint). Exit 2 if any "
                        "is invalid. JSON Schemas of image.yaml, gate.yaml and imagebuild.yaml for editors: "
                        "docs/schemas/.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("images", metavar="IMAGE", nargs="*", help="image names (default: all)")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.validate, version 1)")
    sp.set_defaults(func=cmd_validate)

    sp = sub.add_parser("doctor", help="check this host: engine, BuildKit, image store, disk, memory, tools, "
                        "peers",
                        description="Check that this host can build and ship images: Docker engine "
                        "reachable, buildx and BuildKit versions and the selected builder, containerd image store, "
                        "free disk and memory, git, rsync, ssh, skopeo, the NVIDIA container runtime (a warning "
                        "when absent: the gate's GPU checks are then skipped), and each peer reachable with its own engine. Says what to "
                        "do about each problem. Exit 1 if any check fails (warnings do not fail).",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--peer", action="append", default=[], metavar="HOST",
                    help="also check this SSH peer (repeatable; user@host works)")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.doctor, version 1)")
    sp.set_defaults(func=cmd_doctor)

    sp = sub.add_parser("prefetch", help="pin git sources by SHA, compose forks, pack deterministic tarballs, "
                        "write the lock",
                        description="Fetch every git source of the images into a local mirror cache (only what "
                        "is missing, by raw commit SHA), pin bare PR numbers and ref names to SHAs in "
                        "versions.env (in place), compose each fork (ref + PR heads merged in order, fixed "
                        "identity and date), check the FetchContent dependencies its CMake files declare, pack "
                        "deterministic tarballs into deps-src/IMAGE/src/ with a SHA256SUMS, and write the "
                        "lock's 'sources' section (the build id). A re-run when nothing changed runs no git "
                        "at all. On failure the previous lock and tarballs are left as they were. "
                        "--refresh moves every source; --refresh-source NAME (repeatable, or NAME,NAME) only those. "
                        "--dry-run resolves and says what it would write to versions.env and the lock, and writes "
                        "neither. Details: docs/prefetch.md.",
                        epilog=EPILOG + """
prefetch environment:
  IMAGEBUILD_CACHE         mirror cache folder (default $XDG_CACHE_HOME/imagebuild/git,
                           else ~/.cache/imagebuild/git); --cache overrides it
  IMAGEBUILD_GIT_RETRIES   attempts per network git operation (default 5)
  IMAGEBUILD_RETRY_DELAY   first backoff delay in seconds, doubling (default 1)
  IMAGEBUILD_GIT_TIMEOUT   seconds per git network attempt (default 1800)
  GITHUB_TOKEN             optional: GitHub API token to report PR states (never logged)
""", formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("images", nargs="*", metavar="IMAGE",
                    help="image definitions to prefetch (default: every image with git sources)")
    sp.add_argument("--refresh", action="store_true",
                    help="re-resolve pinned PR heads and followed branches (NAME_REF=<branch>@<sha>) of every source "
                    "and report which moved")
    sp.add_argument("--refresh-source", action="append", metavar="NAME", default=[],
                    help="refresh only this git source (repeatable; NAME,NAME works; --refresh=NAME is the old "
                    "spelling)")
    sp.add_argument("--dry-run", action="store_true", help="resolve, and print the versions.env pins and lock "
                    "sources it would write; write neither, fetch no tarball")
    sp.add_argument("--offline", action="store_true",
                    help="use the mirror cache only; fail naming the first missing object")
    sp.add_argument("--jobs", type=common.count(1, 256), default=4, metavar="N",
                    help="parallel git operations (default 4)")
    _deprecated(sp, "-j", dest="jobs", type=common.count(1, 256), use="--jobs (-j is build's MAX_JOBS)")
    sp.add_argument("--cache", metavar="DIR", help="mirror cache folder (default: $IMAGEBUILD_CACHE, else "
                    "$XDG_CACHE_HOME/imagebuild/git)")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.prefetch, version 1)")
    sp.set_defaults(func=cmd_prefetch)

    sp = sub.add_parser("bundle", help="pack an image's lock and every prefetched file into one verified file "
                        "for a node without GitHub access",
                        description="Write one file holding IMAGE's lock.json and versions.env, every source "
                        "tarball, wheel and deb the lock names (each checked against the lock while it is "
                        "written), a SHA256SUMS and a manifest. Carry it to the build node and run `imagebuild "
                        "unbundle FILE` there. Details: docs/prefetch.md (\"Carry it to an air-gapped node\").",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("image", metavar="IMAGE", help="image name (a folder under docker-images/)")
    sp.add_argument("-o", "--output", required=True, metavar="FILE", help="the bundle to write (a tar)")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.bundle-result, version 1)")
    sp.set_defaults(func=cmd_bundle)

    sp = sub.add_parser("unbundle", help="verify a bundle against its lock, then put its files in place",
                        description="Check FILE's (made by `imagebuild bundle`) headers and manifest before "
                        "writing anything (regular files only, each listed, each of the listed size), stream its "
                        "members into a temporary folder hashing each, verify every file against the bundled "
                        "lock, validate the definition with the bundle's versions.env, and only then move the "
                        "prefetched files, versions.env and lock.json into this project. A bad bundle changes "
                        "nothing (exit 1; 2 when its pins break the definition). After it, `imagebuild build "
                        "IMAGE` needs no network.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("file", metavar="FILE", help="the bundle")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.bundle-result, version 1)")
    sp.set_defaults(func=cmd_unbundle)

    sp = sub.add_parser("gate", help="run an image's gate checks inside it and write a receipt",
                        description="Run the gate spec's checks inside a container of the image (entrypoint "
                        "overridden, --network none, --gpus all when the host has NVIDIA GPUs) through pytest "
                        "and pytest-testinfra's docker backend; print one row per check; write a receipt keyed "
                        "by the image's store-independent identity (.imagebuild/receipts/) and the run's log. "
                        "IMAGE is a definition name: its gate spec, against IMAGE:candidate unless --ref. "
                        "REF is any image reference, with --spec FILE. Without a GPU, checks marked "
                        "`requires: gpu` are SKIPPED (never passed). Exit 4 when the gate fails (a failed "
                        "check of severity error, zero checks, a timeout), 2 for a malformed spec. "
                        "Format and check kinds: docs/gate.md.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("target", metavar="IMAGE|REF", nargs="?", help="definition name, or an image reference (with "
                    "--spec); none: every definition's newest build recorded here that has no receipt of its "
                    "current gate spec yet, one line per definition")
    sp.add_argument("--ref", metavar="REF", help="with IMAGE: the image to gate (default: IMAGE:candidate)")
    sp.add_argument("--spec", metavar="FILE", help="gate spec file (required for a REF; overrides a "
                    "definition's own spec)")
    sp.add_argument("--require-gpu", action="store_true",
                    help="fail, rather than skip, checks marked `requires: gpu` when this host has no GPU")
    sp.add_argument("--junit", metavar="FILE", help="also write a JUnit XML report to FILE")
    sp.add_argument("--check-receipt", action="store_true",
                    help="run nothing: say whether the image (with IMAGE: IMAGE:local unless --ref) has a trusted "
                    "passing receipt of the definition's current gate spec, here or carried by imagebuild sync, "
                    "signed by a key of the allowed-signers file when one is configured (exit 0 passed, 4 not)")
    sp.add_argument("--json", action="store_true", help="print the receipt as JSON (schema imagebuild.receipt, "
                    "version 2)")
    sp.set_defaults(func=cmd_gate)

    sp = sub.add_parser("build", help="build an image's stages offline, cached by key, up to :candidate (and "
                        ":local after its gate passes)",
                        description="Run IMAGE's plan: each stage built with BuildKit FROM its parent, tagged "
                        "with its cache key, skipped when that image exists; every stage under --network none "
                        "unless it declares network: true; prefetched sources checked against the lock and "
                        "bind-mounted as named build contexts. Then the release image (labels, lock, build "
                        "record) tagged IMAGE:b-<build id> and IMAGE:candidate; when the definition has a gate "
                        "spec, the gate runs and IMAGE:local moves only on a passing receipt (the old :local "
                        "becomes :previous). Refuses (exit 3) on a foreign platform, while a serving container "
                        "runs, on low disk, or while another build of IMAGE runs. Logs: "
                        ".imagebuild/builds/IMAGE/BUILD-ID/logs/. Details: docs/build.md.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("image", metavar="IMAGE", help="image name (a folder under docker-images/)")
    sp.add_argument("--from", dest="from_stage", metavar="STAGE",
                    help="start at STAGE (earlier stage images must exist)")
    sp.add_argument("--until", dest="until_stage", metavar="STAGE",
                    help="stop after STAGE (no release image, no promotion unless STAGE is the last)")
    sp.add_argument("--no-cache", action="store_true",
                    help="rebuild the selected stages even when their images exist, without BuildKit's cache")
    sp.add_argument("--force", action="store_true",
                    help="build even while a serving container runs or disk is low (with a warning)")
    sp.add_argument("--emulate", action="store_true",
                    help="allow a target platform other than the host's (QEMU emulation; slow)")
    sp.add_argument("--dry-run", action="store_true", help="check everything and print what would run; build "
                    "nothing")
    sp.add_argument("--jobs", "-j", type=common.count(1, 4096), metavar="N", help="MAX_JOBS for stages that declare it (default: from "
                    "free memory and cores, see docs/build.md)")
    sp.add_argument("--progress", choices=("auto", "tty", "plain", "quiet", "rawjson"), default=None,
                    help="tty: a live line per stage and step with timers and their last output lines; plain: "
                    "a line per step, and a heartbeat every 30 s (the running step, its time, its last output "
                    "line); quiet: only the heartbeat; rawjson: BuildKit's own JSON lines; auto: tty on a "
                    "terminal, otherwise plain (default: $IMAGEBUILD_PROGRESS, then $BUILDKIT_PROGRESS, then "
                    "auto). Every stage's full log is in its log file whatever is shown")
    sp.add_argument("--no-gate", action="store_true", help="stop at IMAGE:candidate even if a gate spec exists")
    sp.add_argument("--check-repro", action="store_true", help="prove the selected stages reproducible: build "
                    "them (as build does), then each once more from the same parent without BuildKit's cache, "
                    "and compare; names every file that differs; no release, no promotion; exit 1 on a "
                    "difference (docs/build.md, Reproducibility)")
    sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="this run only: give the build arg KEY (declared by a stage, from versions.env or a "
                    "default) the value VALUE; a different key and build id, recorded in the build record; "
                    "the build is gated but never promoted to :local without --promote-set (repeatable)")
    sp.add_argument("--promote-set", action="store_true", help="with --set: promote the build to :local when its "
                    "gate passes")
    sp.add_argument("--cache-registry", metavar="HOST:PORT/PREFIX", help="a registry shared by the build nodes: "
                    "stages found there under their key are pulled (verified) instead of built, stages built here "
                    "are pushed, and the gated release is tagged there (default: registry: in imagebuild.yaml)")
    sp.add_argument("--no-cache-registry", action="store_true", help="ignore the registry of imagebuild.yaml")
    sp.add_argument("--engine", metavar="ssh://HOST|CONTEXT", help="build on that engine: every engine call (guards, "
                    "BuildKit, release, tags, gate) goes there; its node's memory, cores and disk are used "
                    "(docs/fleet.md)")
    sp.add_argument("--json", action="store_true", help="print the build record (schema imagebuild.build, "
                    "version 2; with --dry-run: schema imagebuild.build-plan, version 2)")
    sp.set_defaults(func=cmd_build)

    sp = sub.add_parser("sync", help="put the gated image on peer nodes: only the layers they lack, verified",
                        description="Copy IMAGE:local (or --image REF) to each PEER over ssh: ask the peer which "
                        "layers it holds, send only the missing ones with rsync into its cache (an interrupted "
                        "transfer resumes), load them with the peer's own docker load, check the image's "
                        "store-independent identity there, and only then move the peer's tag (the old :local "
                        "becomes :previous) and carry the gate receipt. Refuses (exit 3) an image without a "
                        "passing receipt of its definition's current gate spec, a peer where a running container "
                        "uses the tag, or a peer without enough disk, unless --force (disk: never). A peer that "
                        "already holds the identity is skipped. Details: docs/sync.md.",
                        epilog=EPILOG + """
sync environment:
  IMAGEBUILD_SSH              the ssh command (default ssh), e.g. 'ssh -F ~/.ssh/cluster_config'
  IMAGEBUILD_SYNC_COMPRESS    auto (default) | none | zstd[:LEVEL]: compression on the wire
  IMAGEBUILD_SYNC_CIPHERS     ssh ciphers preference (default ^aes128-gcm@openssh.com,...; empty: ssh's own)
  IMAGEBUILD_PEER_MIN_FREE_GB disk that must stay free on the peer (default 1)
  IMAGEBUILD_PEER_CACHE       (on the peer) its sync cache (default ~/.cache/imagebuild/peer)
  IMAGEBUILD_SYNC_TUNNEL      --via registry: 1 always through an ssh tunnel, 0 never (default: loopback only)
""", formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("peers", nargs="*", metavar="PEER",
                    help="ssh destinations (dgx4, user@host, an ssh alias) or @LIST (peer_lists: in imagebuild.yaml); "
                    "default: peers: in imagebuild.yaml")
    sp.add_argument("--image", metavar="IMAGE|REF", help="a definition name (its :local) or any image reference "
                    "(default: the project's only definition)")
    sp.add_argument("--jobs", type=common.count(1, 256), default=4, metavar="N",
                    help="peers synced in parallel (default 4)")
    _deprecated(sp, "-j", dest="jobs", type=common.count(1, 256), use="--jobs (-j is build's MAX_JOBS)")
    sp.add_argument("--force", action="store_true", help="sync an image without a passing receipt, or move a tag a "
                    "running container uses (with a warning)")
    sp.add_argument("--dry-run", action="store_true", help="probe the peers and say what would be sent; change "
                    "nothing")
    sp.add_argument("--via", choices=("ssh", "registry"), default="ssh", help="ssh (default): send the missing "
                    "layers over ssh; registry: push the image once to the shared registry and let each peer's "
                    "engine pull it by digest (only the layers it lacks), then verify and promote as with ssh "
                    "(docs/fleet.md)")
    sp.add_argument("--registry", metavar="HOST:PORT/PREFIX", help="with --via registry: the registry (default: "
                    "registry: in imagebuild.yaml)")
    sp.add_argument("--tunnel", action=argparse.BooleanOptionalAction, default=None, help="with --via registry: "
                    "the peers reach the registry through an ssh -R tunnel on their loopback (default: only when "
                    "the registry is on this host's loopback)")
    sp.add_argument("--json", action="store_true", help="print the report as JSON (schema imagebuild.sync, version 1)")
    sp.set_defaults(func=cmd_sync)

    sp = sub.add_parser("log", help="list build runs, or show one run's record and logs",
                        description="Without RUN: the recorded build runs (of IMAGE, or of every image), newest "
                        "first, with their status, build id, start and duration. With RUN (a run id, a unique prefix of one, or "
                        "'latest'): that run's stages and log paths; with --stage, that stage's full log. Every "
                        "run keeps its own folder under .imagebuild/builds/IMAGE/RUN/ (record.json, logs/).",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("image", metavar="IMAGE", nargs="?", help="image name (default: every image)")
    sp.add_argument("run", metavar="RUN", nargs="?", help="run id, a unique prefix of one, or 'latest'")
    sp.add_argument("--stage", metavar="STAGE", help="print this stage's log (needs IMAGE; 'release' for the release "
                    "step)")
    sp.add_argument("-n", "--limit", type=common.count(1, 1_000_000), metavar="N", default=None,
                    help="list only the newest N runs")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.log, version 1)")
    sp.set_defaults(func=cmd_log)

    sp = sub.add_parser("shell", help="a shell in a stage: a container of its parent with its inputs, no network",
                        description="Start a container where STAGE's RUN steps run, to see why one failed: FROM "
                        "the stage's parent (the earlier stage's image from the stage store, or the pinned base "
                        "image), --network none (unless the stage declares network: true), the stage's build args "
                        "in the environment, and its inputs, checked against the lock, mounted read-only where "
                        "the build mounts them: /imagebuild/context (what its COPY lines read), /imagebuild/src "
                        "(imagebuild-src), /imagebuild/wheels, /imagebuild/apt. With COMMAND, runs it instead of a "
                        "shell and exits with its code. The container and its temporary tag are removed at the "
                        "end. Details: docs/build.md.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("image", metavar="IMAGE", help="image name (a folder under docker-images/)")
    sp.add_argument("stage", metavar="STAGE", help="the stage whose RUN steps the shell is for")
    sp.add_argument("run_argv", metavar="COMMAND", nargs=argparse.REMAINDER,
                    help="run this (after --) instead of an interactive shell")
    sp.set_defaults(func=cmd_shell)

    sp = sub.add_parser("gc", help="free disk: remove what no kept build needs (--dry-run first)",
                        description="Remove, per image, what no kept build needs: release images and tags of other "
                        "builds, stage-store stages and blobs, prefetched tarballs no kept lock names, package "
                        "folders of removed stages, old run records, temporary folders of runs that died, and "
                        "*.tmp folders a killed prefetch left in the git mirror cache. Kept: the builds IMAGE:local, "
                        ":previous and :candidate point at, the last N builds (--keep), and every image a container "
                        "uses; each with its stages, release image, prefetched files and records, so it still "
                        "rebuilds as a no-op. Only this checkout's builds: what another clone built into the shared stage "
                        "store stays. gc holds each image's build lock while it plans and removes (exit 3 while a "
                        "build, rollback or gc of it runs); an image this checkout does not know is exit 2. "
                        "Retention: docs/build.md, 'Disk'.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("image", metavar="IMAGE", nargs="?", help="image name (default: every image of the project)")
    sp.add_argument("--keep", type=common.count(0, 100_000), default=None, metavar="N", help="also keep the last N builds (default 3; "
                    "with --peer: the records and receipts of the last N synced images, default 5)")
    sp.add_argument("--dry-run", action="store_true", help="remove nothing; list what would go and the bytes freed")
    sp.add_argument("--peer", action="append", default=[], metavar="PEER",
                    help="clean PEER's sync cache instead (repeatable): interrupted transfers older than a day, "
                    "blobs no pending sync needs, staging images, leaked containerd leases of interrupted loads, "
                    "records and receipts beyond the last --keep images (docs/sync.md)")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.gc, version 1; with --peer: "
                    "imagebuild.gc-peer)")
    sp.set_defaults(func=cmd_gc)

    sp = sub.add_parser("df", help="show what each image holds on disk",
                        description="Per image: release images in the engine, the stage store, prefetched files "
                        "(deps-src/IMAGE) and run records, with their sizes; then BuildKit's build cache and the git "
                        "mirror cache. Reads only.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("image", metavar="IMAGE", nargs="?", help="image name (default: every image of this project)")
    sp.add_argument("--all", action="store_true", help="also the images of other checkouts that share the stage "
                    "store (marked *)")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.df, version 1)")
    sp.set_defaults(func=cmd_df)

    sp = sub.add_parser("patch", help="apply or check an image's patch set on a checkout, outside docker",
                        description="Apply IMAGE's patch_*.py files (every stage's, in build order) to the "
                        "source tree DIR with the same primitive the build uses, or with --check only say what "
                        "would happen. Each patch: applied, already-applied, not-needed (upstream has it), "
                        "not-applicable (the code it fixes is not in this tree), would-apply (--check) or failed (naming the patch, file and anchor). Exit 1 when one "
                        "fails. How to write a patch: docs/patches.md.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("image", metavar="IMAGE", help="image name (a folder under docker-images/)")
    sp.add_argument("--src", required=True, metavar="DIR", help="the checkout to patch")
    sp.add_argument("--check", action="store_true", help="change nothing; report what would happen")
    sp.add_argument("--stage", metavar="STAGE", help="only this stage's patches")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.patches, version 1)")
    sp.set_defaults(func=cmd_patch)

    sp = sub.add_parser("rollback", help="swap IMAGE:local and IMAGE:previous",
                        description="Point IMAGE:local back at IMAGE:previous (what :local was before the last "
                        "promotion); the replaced image becomes IMAGE:previous, so a second rollback undoes the "
                        "first. Exit 1 when there is no :previous; 2 for a name that is not one of the project's "
                        "definitions; 3 while a build or gc of the image holds its build lock.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("image", metavar="IMAGE", help="image name")
    sp.add_argument("--registry", nargs="?", const="", metavar="HOST:PORT/PREFIX", help="swap the tags in the "
                    "shared registry instead (default: registry: in imagebuild.yaml); the engine is not touched")
    sp.add_argument("--dry-run", action="store_true", help="say which tags would move where; move none")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.rollback, version 1)")
    sp.set_defaults(func=cmd_rollback)

    sp = sub.add_parser("config", help="show the effective settings (root, state, stage store, caches, locks, "
                        "peers, registry) and where each came from",
                        description="Print the settings a command would use here: the project root, the state "
                        "folder, the stage store, the caches, the lock folder, the peers and the registry, each "
                        "with its origin (flag, environment, imagebuild.yaml, default) and the flag, variable or "
                        "key it came from; then those of imagebuild's environment variables that are set (--env: "
                        "every one, set or not, with what it does). Secrets are never shown. Reads only. "
                        "Outside a project, the root and state are shown as none.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--env", action="store_true", help="list every environment variable read by imagebuild")
    sp.add_argument("--json", action="store_true", help="print JSON (schema imagebuild.config, version 1)")
    sp.set_defaults(func=cmd_config)

    sp = sub.add_parser("help", help="show the top-level help, or one command's help",
                        description="Print the help of COMMAND (the same as imagebuild COMMAND --help), or "
                        "without COMMAND the top-level help: the commands by step, the exit codes, the "
                        "environment, where the docs are.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("topic", metavar="COMMAND", nargs="?", help="a command")
    sp.set_defaults(func=cmd_help)

    if only and only not in NIGHTLY_COMMANDS:  # their names only (for argparse's choices): no import
        for name in NIGHTLY_COMMANDS:
            sub.add_parser(name)
        return p
    from imagebuild.cli import nightly as cli_nightly  # nightly, report, diff (docs/nightly.md)

    cli_nightly.register(sub, EPILOG)
    return p


NIGHTLY_COMMANDS = ("nightly", "report", "diff")  # cli_nightly.register adds them


def _setup_logging(args) -> None:
    """Configure the "imagebuild" logger: now if logging is loaded, else when something first imports
    it (``list``, ``validate`` and ``plan --no-engine`` never do: ~10 ms saved on each start)."""
    if "logging" in sys.modules or args.verbose or args.debug:  # -v: every command run is logged
        _configure_logging(args)
    elif not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported("logging", lambda: _configure_logging(args)))


class _WhenImported:
    """A meta path entry that runs ``then()`` right after module ``name`` is first imported."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module):
            exec_module(module)
            self.then()

        spec.loader.exec_module = exec_then
        return spec


def _json_lines(args) -> bool:
    """``--progress rawjson`` (or its environment default) on build or nightly: stderr carries JSON lines
    only, BuildKit's and, wrapped as ``{"imagebuild": {"level": ..., "message": ...}}``, imagebuild's own
    (its notes, warnings and the final error), so a tool can read every line."""
    if not hasattr(args, "progress"):
        return False
    from imagebuild.build import progress as progress_mod

    return progress_mod.resolve_mode(args.progress, isatty=False) == "rawjson"


def _json_line(level: str, message: str) -> str:
    import json

    return json.dumps({"imagebuild": {"level": level, "message": message}}, ensure_ascii=False)


def _say(args, level: str, text: str) -> None:
    """A line of imagebuild's own on stderr (an error, 'interrupted'): a JSON line under rawjson."""
    print(_json_line(level, text) if getattr(args, "json_lines", False) else text, file=sys.stderr)


def _configure_logging(args) -> None:
    import logging

    # -v: also every command run ("+ docker ...") and the build logs as they come; --debug: and tracebacks
    level = logging.DEBUG if (args.debug or args.verbose) else logging.WARNING if args.quiet else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    if getattr(args, "json_lines", False):
        class JsonLines(logging.Formatter):
            def format(self, record: logging.LogRecord) -> str:
                return _json_line(record.levelname.lower(), shown(record.getMessage()))

        handler.setFormatter(JsonLines())
    else:
        class Shown(logging.Formatter):  # printable text, no URL userinfo (core/errors.shown)
            def format(self, record: logging.LogRecord) -> str:
                return shown(super().format(record))

        handler.setFormatter(Shown("%(message)s"))
    logger = logging.getLogger("imagebuild")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


# ------------------------------------------------------------------------------------------------ list


def cmd_list(args) -> int:
    root = common.root(args)
    rows = []
    for name in defn_mod.list_images(root):
        try:
            dfn = defn_mod.load(root, name)
            rows.append({"name": name, "valid": True, "platform": dfn.platform,
                         "stages": [s.name for s in dfn.stages], "description": dfn.description,
                         "unpinned": len(dfn.notices), "problems": 0})
        except DefinitionError as exc:
            rows.append({"name": name, "valid": False, "platform": None, "stages": [], "description": None,
                         "unpinned": 0, "problems": len(exc.problems)})
    for name in defn_mod.misnamed_images(root):  # listed INVALID, never skipped
        rows.append({"name": name, "valid": False, "platform": None, "stages": [], "description": None,
                     "unpinned": 0, "problems": 1})
    if args.json:
        common.print_json({"schema": "imagebuild.list", "version": 1, "images": rows})
        return EXIT_OK
    if not rows:
        print(f"no image definitions in {defn_mod.display_path(os.getcwd() and root, root / 'docker-images')}")
        return EXIT_OK
    w = max(len(r["name"]) for r in rows)
    for r in rows:
        if r["valid"]:
            extra = f", {r['unpinned']} unpinned" if r["unpinned"] else ""
            print(f"{r['name']:<{w}}  {r['platform']:<12} {len(r['stages'])} stages ({' -> '.join(r['stages'])})"
                  f"{extra}")
        elif not defn_mod.NAME_RE.match(r["name"]):
            shown = _shown_name(r["name"])
            print(f"{shown:<{w}}  INVALID      the folder name is no image name: imagebuild validate")
        else:
            print(f"{r['name']:<{w}}  INVALID      {r['problems']} problem(s): imagebuild validate {r['name']}")
    return EXIT_OK


def _shown_name(name: str) -> str:
    from imagebuild.core.errors import excerpt

    return name if name.isprintable() and name.isascii() and len(name) <= 32 else excerpt(name)


def _misnamed_problem(root, name: str):
    import re

    from imagebuild.core.errors import Problem

    fixed = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._")[:40] or "my-image"
    return Problem(f"{defn_mod.IMAGES_DIR}/{_shown_name(name)}", "this folder holds an image.yaml but its name "
                   "is no image name (lower-case letters, digits, '.', '_', '-'; at most 100 characters): "
                   "no command can use it", key="IMAGE", hint=f"rename the folder, e.g. to {fixed!r}")


# ------------------------------------------------------------------------------------------------ validate


def cmd_validate(args) -> int:
    root = common.root(args)
    names = args.images or defn_mod.list_images(root)
    results = []
    for name in names:
        try:
            dfn = defn_mod.load(root, name)
            results.append({"image": name, "valid": True, "problems": [],
                            "unpinned": [n.render() for n in dfn.notices]})
        except DefinitionError as exc:
            results.append({"image": name, "valid": False, "problems": [p.as_dict() for p in exc.problems],
                            "unpinned": []})
            if not args.json:
                print(_verdicts(exc.render(), sys.stderr), file=sys.stderr)
    for name in [] if args.images else defn_mod.misnamed_images(root):  # never skipped
        exc = DefinitionError([_misnamed_problem(root, name)], image=_shown_name(name))
        results.append({"image": name, "valid": False, "problems": [p.as_dict() for p in exc.problems],
                        "unpinned": []})
        if not args.json:
            print(_verdicts(exc.render(), sys.stderr), file=sys.stderr)
    settings = _validate_settings(root, args.json)
    if args.json:
        common.print_json({"schema": "imagebuild.validate", "version": 1, "results": results, "settings": settings})
    else:
        if settings["present"] and settings["valid"]:
            print(f"{settings['file']}: ok")
        for r in results:
            if r["valid"]:
                print(f"{r['image']}: ok" + (f" ({len(r['unpinned'])} unpinned)" if r["unpinned"] else ""))
                for u in r["unpinned"]:
                    print(f"  unpinned: {u}")
    return EXIT_OK if all(r["valid"] for r in results) and settings["valid"] else EXIT_BAD_INPUT


def _validate_settings(root, quiet: bool) -> dict:
    """validate's check of the project's imagebuild.yaml (core/config.py): its problems on stderr."""
    from imagebuild.core import config as config_mod

    doc = {"file": config_mod.CONFIG_FILE, "present": (root / config_mod.CONFIG_FILE).exists(), "valid": True,
           "problems": []}
    try:
        config_mod.load(root)
    except DefinitionError as exc:
        doc.update(valid=False, problems=[p.as_dict() for p in exc.problems])
        if not quiet:
            print(_verdicts(exc.render(), sys.stderr), file=sys.stderr)
    return doc


# ------------------------------------------------------------------------------------------------ plan


def cmd_plan(args) -> int:
    from imagebuild.build.stagestore import StageStore

    root = common.root(args)
    # the engine is asked first and answers while the definition is read (engine.EngineQuery)
    query = None if args.no_engine else engine_mod.EngineQuery()
    dfn = defn_mod.load(root, args.image)
    pending = plan_mod.provenance.start(dfn)  # git answers while the rest is read and computed
    store = StageStore.for_image(root, dfn.name)  # built stages: read from the stage store, no engine needed
    engine_info = None
    if query is not None:
        info = query.result()
        engine_info = info.as_dict()
        if not info.reachable:
            log.info("no Docker engine reachable (%s)", info.detail)
    plan = plan_mod.make_plan(dfn, exists=lambda key: store.lookup(key) is not None, engine=engine_info,
                              prov=pending)
    if args.json:
        common.print_json(plan.as_dict())
        return EXIT_OK
    _print_plan(plan)
    return EXIT_OK


def _red(text: str, stream=None) -> str:
    """``text`` in red when ``stream`` (stdout) is a terminal and NO_COLOR is not set."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or not getattr(stream, "isatty", lambda: False)():
        return text
    return f"\033[31m{text}\033[0m"


_VERDICT_COLOURS = {"PASS": "32", "PASSED": "32", "FAIL": "31", "FAILED": "31", "error:": "31"}


def _verdicts(text: str, stream=None) -> str:
    """``text`` with each line's leading PASS/PASSED (green), FAIL/FAILED or ``error:`` (red) coloured,
    only when ``stream`` is a terminal and NO_COLOR is not set (a pipe or a log gets plain text)."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or not getattr(stream, "isatty", lambda: False)():
        return text
    out = []
    for ln in text.split("\n"):
        word = ln.split(" ", 1)[0].rstrip(":") if ln.startswith(("PASS", "FAIL", "error:")) else ""
        word = "error:" if ln.startswith("error:") else word
        code = _VERDICT_COLOURS.get(word)
        out.append(f"\033[{code}m{word}\033[0m{ln[len(word):]}" if code else ln)
    return "\n".join(out)


def _print_plan(plan: plan_mod.Plan) -> None:
    print(f"image     {plan.image}")
    print(f"platform  {plan.platform}")
    print(f"build id  {plan.build_id}  (from {plan.build_id_from})")
    if plan.provenance is not None:
        print(f"revision  {plan.provenance.revision or '(not in git)'}  definition {plan.provenance.definition_sha256[:23]}")
        if plan.provenance.dirty_paths:  # what makes it dirty though every file is committed
            print(f"          in a context, held by no commit: {', '.join(plan.provenance.dirty_paths)}")
    for i, s in enumerate(plan.stages, start=1):
        exists = {True: "built", False: "to build", None: "unknown"}[s.exists]
        print(f"\n{i}. {s.name}  [{exists}]")
        print(f"   image       {s.image}")
        print(f"   key         {s.key}")
        print(f"   dockerfile  {s.dockerfile}")
        print(f"   from        {s.parent} ({s.parent_kind}) = {s.parent_ref}")
        if s.uses_stages:
            print(f"   uses        {', '.join(s.uses_stages)}")
        for a in s.args:
            print(f"   arg         {a.name}={a.value}  ({a.origin})")
        for inp in s.inputs:
            print(f"   input       {inp.path} -> {inp.context_path}  sha256:{inp.sha256[:16]}  ({inp.kind})")
        for src in s.sources:
            print(f"   source      {src}")
        if s.src_mounts is not None:
            for m in s.src_mounts["mounts"]:
                dep = f", dependency of {m['dependency_of']}" if m["dependency_of"] else ""
                print(f"   mounts      {m['name']} {m['tarball']}  sha256:{m['sha256'][:16]} -> {m['dir']}{dep}")
                for o in m["overrides"]:
                    print(f"   override    {o['name']}={o['value']}  ({'environment' if o['via'] == 'env' else '-D'})")
            for x in s.src_mounts["excluded"]:
                print(f"   excluded    {x['name']} ({x['declared_by']} at {x['where']}): {x['reason']}")
            for n in s.src_mounts["missing"]:
                print(f"   mounts      {n}: NOT PREFETCHED (imagebuild prefetch {plan.image})")
        for pc in s.patch_check:
            why = " (patch changed since prefetch checked it)" if pc["stale"] else ""
            msg = f"  {pc['message'].splitlines()[0]}" if pc["message"] and pc["outcome"] != "would-apply" else ""
            print(f"   patch       {pc['outcome']:<15} {pc['patch']}{why}{msg}")
        for m in s.mounts:
            if m.stale and m.sha256:
                print(f"   STALE       {m.name}: {m.stale} (imagebuild prefetch {plan.image})")
        print(f"   epoch       SOURCE_DATE_EPOCH={s.source_date_epoch}")
        for kind, pk in sorted(s.packages.items()):
            state = "locked " + pk["locked"][:16] if pk["locked"] else "NOT PREFETCHED for these inputs"
            print(f"   {kind:<11} inputs {pk['inputs'][:16]}  {state}")
        if s.network:
            print("   network     " + _red("NEEDS NETWORK (declared 'network: true')"))
    if plan.unpinned:
        print("\nunpinned (imagebuild prefetch resolves these):")
        for n in plan.unpinned:
            print(f"  {n.render()}")


# ------------------------------------------------------------------------------------------------ doctor


def cmd_prefetch(args) -> int:
    import re

    from imagebuild.fetch import prefetch as prefetch_mod

    ctx = common.ctx(args)
    if args.refresh:  # the old `--refresh NAME...`: a source name is upper case, an image name never is
        old = [n for n in args.images if re.fullmatch(r"[A-Z][A-Z0-9_]*", n)]
        if old:
            print(f"warning: --refresh {' '.join(old)}: taken as --refresh-source {','.join(old)} (the old "
                  "spelling, deprecated: --refresh takes no value now)", file=sys.stderr)
            args.images = [n for n in args.images if n not in old]
            args.refresh_source = [*args.refresh_source, *old]
    for name in args.images:
        defn_mod.check_image_name(name)
    named = [n for v in args.refresh_source for n in v.split(",") if n]
    refresh = named if named else ([] if args.refresh else None)
    report = prefetch_mod.prefetch(ctx, args.images or None, refresh=refresh, offline=args.offline,
                                   jobs=args.jobs, cache_dir=args.cache, dry_run=args.dry_run)
    if args.json:
        common.print_json(report.as_dict())
    else:
        print(prefetch_mod.render(report))
    return report.exit_code


def cmd_bundle(args) -> int:
    from imagebuild.core.fsutil import check_output_file
    from imagebuild.fetch import bundle as bundle_mod

    ctx = common.ctx(args)
    defn_mod.check_image_name(args.image)
    res = bundle_mod.bundle(ctx, args.image, check_output_file(args.output, "-o/--output"))
    if args.json:
        common.print_json(res.as_dict())
    else:
        print(f"{res.image}: {res.files} files, {human_bytes(res.bytes)} -> {res.file}")
    return EXIT_OK


def cmd_unbundle(args) -> int:
    from imagebuild.fetch import bundle as bundle_mod

    res = bundle_mod.unbundle(common.ctx(args), args.file)
    if args.json:
        common.print_json(res.as_dict())
    else:
        print(f"{res.image}: {res.files} files, {human_bytes(res.bytes)} verified and in place; "
              f"`imagebuild build {res.image}` needs no network now")
        for r in res.replaced:
            print(f"  replaced {r} (the bundle's pins)")
        for n in res.notices:
            print(f"  note   {n}")
    return EXIT_OK


def cmd_doctor(args) -> int:
    try:
        ctx = common.ctx(args)
    except ImagebuildError:
        ctx = None  # doctor checks the host also outside a project, even with a bad --root
    checks = doctor_mod.run_checks(ctx, peers=args.peer)
    if args.json:
        common.print_json({"schema": "imagebuild.doctor", "version": 1, "checks": [c.as_dict() for c in checks]})
    else:
        w = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.status.upper():<4}  {c.name:<{w}}  {c.detail}")
            if c.fix and c.status != "ok":
                print(f"{'':<4}  {'':<{w}}  -> {c.fix}")
    return EXIT_FAILED if any(c.status == "fail" for c in checks) else EXIT_OK


# ------------------------------------------------------------------------------------------------ gate


def cmd_gate(args) -> int:
    if args.target is None:
        return _gate_pending(args)
    if args.check_receipt:
        return _check_receipt(args)
    from imagebuild.gate import runner as gate_mod  # imports pytest: only when gating

    if args.junit is not None:
        from imagebuild.core.fsutil import check_output_file

        args.junit = str(check_output_file(args.junit, "--junit"))
    ctx = common.ctx_or_none(args)  # a bare REF + --spec works outside a project too
    target = gate_mod.resolve(ctx, args.target, ref=args.ref, spec=args.spec)
    receipt = gate_mod.execute(target, require_gpu=args.require_gpu, junit=args.junit)
    if args.json:
        common.print_json(receipt.data)
    else:
        print(_verdicts(gate_mod.render_table(receipt, target.root)))
    if not receipt.passed:
        raise gate_mod.failure(receipt)
    return EXIT_OK


def _gate_pending(args) -> int:
    """``imagebuild gate`` alone: gate what was built here and not yet gated (gate_mod.pending says
    which, and why not the others); the tables of those gated, then one line per definition. The
    exit code is the worst: 4 when a gate failed, 2 for a definition that does not load."""
    given = [f for f, v in (("--ref", args.ref), ("--spec", args.spec), ("--check-receipt", args.check_receipt),
                            ("--junit", args.junit)) if v]
    if given:
        raise UsageError(f"{given[0]} needs an IMAGE or REF", hint=f"imagebuild gate IMAGE {given[0]} ...")
    from imagebuild.gate import runner as gate_mod  # imports pytest: only when gating

    rows = []
    for p in gate_mod.pending(common.ctx(args)):
        if p.target is None:
            rows.append({"image": p.image, "status": p.status, "ref": None, "detail": p.detail,
                         "receipt": None, "exit_code": p.exit_code})
            continue
        log.info("%s: gating %s (built here, not yet gated)", p.image, p.target.ref)
        try:
            receipt = gate_mod.execute(p.target, require_gpu=args.require_gpu)
        except ImagebuildError as exc:  # the next definition is still gated; the error in full on stderr
            _say(args, "error", exc.render())
            rows.append({"image": p.image, "status": "failed", "ref": p.target.ref,
                         "detail": exc.message.splitlines()[0], "receipt": None, "exit_code": exc.exit_code})
            continue
        s = receipt.data["summary"]
        detail = (f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped of {s['total']}"
                  + (f" ({receipt.data['reason']})" if receipt.data["reason"] else "")
                  + (f"; :local unchanged: imagebuild build {p.image} promotes it" if receipt.passed else ""))
        rows.append({"image": p.image, "status": "passed" if receipt.passed else "failed", "ref": p.target.ref,
                     "detail": detail, "receipt": str(receipt.path),
                     "exit_code": EXIT_OK if receipt.passed else EXIT_GATE_FAILED})
        if not args.json:
            print(_verdicts(gate_mod.render_table(receipt, p.target.root)) + "\n")
    code = max((r["exit_code"] for r in rows), default=EXIT_OK)
    if args.json:
        common.print_json({"schema": "imagebuild.gate-pending", "version": 1, "exit_code": code, "images": rows})
        return code
    if not rows:
        print("no image definitions")
    for r in rows:
        what = f"{r['status']} {r['ref']}" if r["ref"] else r["status"]
        print(_verdicts(f"{r['image']}: {what}: {r['detail']}"))
    return code


def _check_receipt(args) -> int:
    """``gate --check-receipt``: a passing receipt for the image, in this project's state folder or
    among those ``imagebuild sync`` carried to this node (receipts.synced_dir())."""
    from pathlib import Path

    from imagebuild.build import promote as promote_mod
    from imagebuild.core import identity as identity_mod
    from imagebuild.definition import gatespec
    from imagebuild.gate import receipts, signing

    ctx = common.ctx_or_none(args)
    root = ctx.root if ctx is not None else None
    is_defn = root is not None and defn_mod.NAME_RE.match(args.target) and \
        (root / defn_mod.IMAGES_DIR / args.target / defn_mod.IMAGE_FILE).is_file()
    if is_defn:
        image, ref = args.target, args.ref or f"{args.target}:local"
        spec = gatespec.digest(Path(args.spec)) if args.spec else promote_mod.current_spec_digest(ctx, image)
        if spec is None:
            raise UsageError(f"image {image!r} has no gate spec: no receipt can say it passed")
    else:
        if args.ref:
            raise UsageError("--ref only goes with an IMAGE (a definition name)")
        image, ref = None, args.target
        spec = gatespec.digest(Path(args.spec)) if args.spec else None
    ident = identity_mod.inspect(ref)  # the identity of the image here: a receipt must re-hash to it
    spec_file = Path(args.spec) if args.spec else (promote_mod.current_spec(ctx, image) if is_defn else None)
    allowed = signing.allowed_signers(ctx.config if ctx is not None else None)
    verdicts = []
    if ctx is not None and spec:
        verdicts.append(receipts.check(ctx, ident.digest, spec, spec=spec_file))
    if not any(v.trusted for v in verdicts):
        hit = receipts.check_synced(ident.digest, spec, spec=spec_file, allowed=allowed)
        if hit is not None:
            verdicts.append(hit)
    good = next((v for v in verdicts if v.trusted), None)
    found, where = (good.data, good.path) if good else (None, None)
    doc = {"schema": "imagebuild.receipt-check", "version": 1, "ref": ref, "identity": ident.digest, "spec": spec,
           "passed": found is not None, "receipt": str(where) if where else None,
           "synced": bool(where and receipts.synced_dir() in Path(where).parents),
           "gpu_checks_skipped": bool(found and found.get("gpu_checks_skipped")),
           "host": (found or {}).get("host", {}).get("hostname"),
           "signed": bool(good and good.signed), "signer": good.signer if good else None,
           "allowed_signers": str(allowed) if allowed else None,
           "untrusted": [{"receipt": str(v.path), "reason": v.reason} for v in verdicts if v.untrusted]}
    if args.json:
        common.print_json(doc)
    elif found:
        print(_verdicts(f"PASSED  {ref}  identity {short_digest(ident.digest)}"))
        print(f"        receipt {where}" + ("  (carried by imagebuild sync)" if doc["synced"] else "") +
              f"; gated on {doc['host'] or '?'}" + ("; GPU checks skipped" if doc["gpu_checks_skipped"] else ""))
        if good.signer:
            print(f"        signed by {good.signer} (verified against {allowed})")
    if found is None:
        what = f"of {image}'s current gate spec ({spec[:19]})" if image else \
            (f"of spec {spec[:19]}" if spec else "of any definition's gate spec")
        why = "".join(f"; the receipt {v.path} is not trusted: {v.reason}" for v in verdicts if v.untrusted)
        raise GateFailed(f"{ref} ({ident.digest}) has no trusted passing receipt {what}, here or carried by sync"
                         + why, hint=f"imagebuild gate {image or ref}" + ("" if image else " --spec FILE"))
    return EXIT_OK


# ------------------------------------------------------------------------------------------------ build


def cmd_build(args) -> int:
    from imagebuild.core import remote_engine

    engine = remote_engine.resolve(args.engine) if args.engine is not None else None
    with remote_engine.use(engine):
        return _cmd_build(args)


def _overrides(values: list[str]) -> dict[str, str]:
    """``--set KEY=VALUE`` (repeatable) -> {KEY: VALUE}; a word without ``=``, an empty KEY or a KEY given
    twice is a usage error (exit 2). Which KEYs a definition takes: planner.check_overrides."""
    out: dict[str, str] = {}
    for v in values:
        key, eq, value = v.partition("=")
        if not eq or not key or not key.replace("_", "").isalnum():
            raise UsageError(f"--set {v!r}: expected KEY=VALUE (a build arg's name, then its value)",
                             hint="imagebuild build IMAGE --set TOOL_VERSION=1.1")
        if key in out:
            raise UsageError(f"--set {key}: given twice")
        out[key] = value
    return out


def _cmd_build(args) -> int:
    from imagebuild.build import builder as build_mod

    ctx = common.ctx(args)
    if args.cache_registry and args.no_cache_registry:
        raise UsageError("--cache-registry and --no-cache-registry cannot be used together")
    registry = None if args.no_cache_registry else (args.cache_registry or ctx.config.registry)
    if args.check_repro and args.cache_registry:
        raise UsageError("--check-repro proves what this host builds: it pulls no stage from a registry",
                         hint="leave out --cache-registry")
    if args.check_repro:
        registry = None
    if registry:
        from imagebuild.core import registry as registry_mod

        registry_mod.parse(registry, what="--cache-registry" if args.cache_registry else "imagebuild.yaml: registry")
    opts = build_mod.Options(from_stage=args.from_stage, until_stage=args.until_stage, no_cache=args.no_cache,
                             force=args.force, dry_run=args.dry_run, jobs=args.jobs, emulate=args.emulate,
                             gate=not args.no_gate, progress=args.progress, registry=registry,
                             check_repro=args.check_repro, overrides=_overrides(args.overrides),
                             promote_set=args.promote_set)
    if args.dry_run and args.check_repro:
        raise UsageError("--check-repro builds every selected stage twice; --dry-run builds nothing",
                         hint="use one of them")
    if args.dry_run:
        doc = build_mod.dry_run(ctx, args.image, opts)
        if args.json:
            common.print_json(doc)
        else:
            print(f"image     {doc['image']}  ({doc['platform']}, build id {doc['build_id']}, "
                  f"SOURCE_DATE_EPOCH {doc['source_date_epoch']})")
            import shlex

            print(f"stages    {doc['stage_store']} (OCI layout; each stage's file times clamped to its SOURCE_DATE_EPOCH)")
            for i, s in enumerate(doc["stages"], start=1):
                print(f"{i}. {s['name']:<16} {s['action']:<14} {s['image']}  ({s['reason']}; network {s['network']})")
                if s["command"]:
                    print("   " + shlex.join(s["command"]))
            print("then: release image, :b-<build id>, :candidate" if doc["release"] else
                  "then: stop (--until), no release image")
        return EXIT_OK
    try:
        rec = build_mod.build(ctx, args.image, opts)
    except GateFailed as exc:  # exit 4, and --json still prints the run's record
        if args.json and isinstance(getattr(exc, "record", None), dict):
            common.print_json(exc.record)
        raise
    if args.json:
        common.print_json(rec)
    else:
        for s in rec["stages"]:
            print(f"{s['name']:<16} {s['status']:<8} {s['image']}" +
                  (f"  ({s['seconds']:.1f} s)" if s.get("seconds") is not None else ""))
        if rec.get("release"):
            print(f"candidate        {', '.join(rec['release']['tags'])}  identity "
                  f"{short_digest(rec['release']['identity'])}")
        if rec.get("promotion"):
            p = rec["promotion"]
            print(f"promotion        {p['status']}" + (f": {p.get('reason')}" if p.get("reason") else "") +
                  (" (:local already held this identity)" if p["status"] == "unchanged" else ""))
        if rec.get("registry"):
            r = rec["registry"]
            print(f"registry         {r['address']}: {r['pulled']} stage(s) pulled, {r['pushed']} pushed, "
                  f"{r['refused']} refused" + (f"; dropped: {r['down']}" if r["down"] else ""))
        if rec.get("publish"):
            p = rec["publish"]
            print(f"published        {p['repository']}:{p['release']['tag']} ({p['release']['digest'][:19]}), "
                  f":local {'moved' if p['moved'] else 'unchanged'}" if p["status"] == "published" else
                  f"published        {p['status']}: {p['reason']}")
        for c in (rec.get("repro") or {}).get("stages", []):
            print(f"{c['name']:<16} {'same' if c['same'] else 'DIFFERS':<8} built twice: {c['first']}" +
                  ("" if c["same"] else f" and {c['second']}"))
            for d in c["differences"]:
                print(f"                   {d['path']}: {', '.join(d['differs'])} (layer {d['layer']})")
        print(f"run              {rec['run_id']} (imagebuild log {rec['image']} {rec['run_id']})")
    if rec.get("repro") and not rec["repro"]["same"]:
        bad = [c["name"] for c in rec["repro"]["stages"] if not c["same"]]
        log.error("error: not reproducible: stage(s) %s gave another manifest when built again (the files that "
                  "differ are listed above; docs/build.md, Reproducibility)", ", ".join(bad))
        return EXIT_FAILED
    return EXIT_OK


def cmd_shell(args) -> int:
    from imagebuild.build import shell as shell_mod

    command = args.run_argv[1:] if args.run_argv[:1] == ["--"] else args.run_argv
    return shell_mod.shell(common.ctx(args), args.image, args.stage, command or None)


def cmd_log(args) -> int:
    from imagebuild.core import runs as runs_mod

    ctx = common.ctx(args)
    if args.image:  # one of this project's images, else exit 2
        from imagebuild.ops import gc as gc_mod

        gc_mod.check_known(ctx, args.image)
    if args.run is None and args.stage is None:
        runs = runs_mod.list_runs(ctx, args.image)[:args.limit]
        if args.json:
            common.print_json({"schema": "imagebuild.log", "version": 1, "runs": [r.summary() for r in runs]})
            return EXIT_OK
        if not runs:
            print("no build runs recorded" + (f" for {args.image}" if args.image else ""))
            return EXIT_OK
        iw = max(5, *(len(r.image) for r in runs))
        rw = max(3, *(len(r.run_id) for r in runs))
        print(f"{'IMAGE':<{iw}}  {'RUN':<{rw}}  {'STATUS':<12} {'BUILD':<16} {'STARTED':<20} {'TOOK':>8}  NOTE")
        for r in runs:
            s = r.summary()
            note = "; ".join(x for x in (f"failed at {s['failed_stage']}" if s["failed_stage"] else "",
                                         s["promotion"] or "") if x)
            print(f"{r.image:<{iw}}  {r.run_id:<{rw}}  {s['status']:<12} {s['build_id'] or '-':<16} "
                  f"{(s['started'] or '-')[:19]:<20} {_took(s['started'], s['finished']):>8}  {note}".rstrip())
        return EXIT_OK
    if not args.image:
        raise UsageError("RUN and --stage need an IMAGE", hint="imagebuild log IMAGE [RUN] [--stage STAGE]")
    if args.stage is not None and not defn_mod.STAGE_RE.match(args.stage) and args.stage != "release":
        raise UsageError(f"--stage {args.stage!r}: expected a stage name (or 'release')",
                         hint=f"imagebuild log {args.image} {args.run or 'latest'} lists the run's stages")
    run = runs_mod.find_run(ctx, args.image, args.run)
    if args.stage is not None:
        path = run.dir / "logs" / f"{args.stage}.log"
        if not path.is_file():
            have = ", ".join(p.stem for p in run.logs()) or "none"
            raise UsageError(f"run {run.run_id} of {args.image} has no log for stage {args.stage!r}",
                             hint=f"logs of that run: {have}")
        with open(path, "rb") as f:  # printable text only (a log written before imagebuild stripped it all)
            for raw in f:
                sys.stdout.write(printable(raw.decode("utf-8", "replace")))
        return EXIT_OK
    if args.json:
        common.print_json({"schema": "imagebuild.log", "version": 1, "run": run.summary(), "record": run.record,
                     "logs": [ctx.show(p) for p in run.logs()]})
        return EXIT_OK
    s = run.summary()
    for p in run.problems():  # a record not written by a build (edited, another version): shown as far as it goes
        log.warning("warning: %s: %s (shown as -)", ctx.show(run.dir / "record.json"), p)
    print(f"run       {run.run_id}  ({args.image}, {s['status']})")
    print(f"build id  {s['build_id'] or '-'}")
    print(f"started   {s['started'] or '-'}  finished {s['finished'] or '-'}  took {_took(s['started'], s['finished'])}")
    for st in run.stages():
        took = f"{st['seconds']:.1f} s" if st["seconds"] is not None else ""
        print(f"  {st['name'] or '-':<16} {st['status'] or '-':<8} {took:>9}  {st['log'] or ''}")
    if s["identity"]:
        print(f"identity  {short_digest(s['identity'])}")
    if s["promotion"]:
        print(f"promotion {s['promotion']}")
    for p in run.logs():
        print(f"log       {ctx.show(p)}")
    return EXIT_OK


def _took(started: str | None, finished: str | None) -> str:
    """A run's duration from its record's ISO times (``1h02m``, ``3m05s``, ``12s``), ``-`` when unknown."""
    from datetime import datetime

    try:
        secs = (datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds()
    except (TypeError, ValueError):
        return "-"
    if secs < 0:
        return "-"
    h, rest = divmod(int(round(secs)), 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def cmd_gc(args) -> int:
    from imagebuild.ops import gc as gc_mod

    if args.peer:
        return _cmd_gc_peer(args)
    if args.keep is None:
        args.keep = gc_mod.DEFAULT_KEEP
    ctx = common.ctx(args)
    if args.keep < 0:
        raise UsageError(f"--keep {args.keep}: expected 0 or more")
    if args.image:  # an unknown image: exit 2 before the engine is asked
        gc_mod.check_known(ctx, args.image)
    if not args.dry_run:  # a gate killed with -9 left its container: its build is not "used by a container"
        from imagebuild.gate import leftovers

        leftovers.reap()
    # a busy image (its build lock held by a build, rollback or gc): exit 3, nothing removed
    plan = gc_mod.collect(ctx, args.image, args.keep, dry_run=args.dry_run)
    if args.json:
        common.print_json(plan.as_dict(args.dry_run))
        return EXIT_OK
    h = gc_mod.human
    verb = "would remove" if args.dry_run else "removed"
    for ip in plan.images:
        kept = ", ".join(f"{b} ({why})" for b, why in ip.kept_builds.items()) or "none"
        print(f"{ip.image}: keeping builds {kept}")
        for it in ip.remove:
            print(f"  {verb:<12} {it.kind:<12} {it.what}  {h(it.bytes)}  ({it.why})")
        for sk in ip.skipped:
            print(f"  left alone   {sk}")
        print(f"  {ip.image}: {h(ip.freed)} {'to free' if args.dry_run else 'freed'}")
    for it in plan.shared:
        print(f"{verb:<12} {it.kind:<12} {it.what}  {h(it.bytes)}  ({it.why})")
    print(f"total: {h(plan.freed)} {'would be freed' if args.dry_run else 'freed'}")
    return EXIT_OK


def cmd_df(args) -> int:
    from imagebuild.ops import gc as gc_mod

    ctx = common.ctx(args)
    doc = gc_mod.disk_usage(ctx, args.image)
    others = [r for r in doc["images"] if not r["this_project"]]
    if not args.all and not args.image:  # the shared stage store also holds other checkouts' images
        doc = {**doc, "images": [r for r in doc["images"] if r["this_project"]], "other_images": len(others)}
    if args.json:
        common.print_json(doc)
        return EXIT_OK
    h = gc_mod.human
    print(f"{'IMAGE':<24} {'ENGINE':>12} {'STAGES':>12} {'PREFETCHED':>12} {'RUNS':>10} {'TOTAL':>12}")
    for r in doc["images"]:
        mark = "" if r["this_project"] else "  (not this project's: another checkout's, in the shared stage store)"
        print(f"{r['image'] + ('*' if mark else ''):<24} {h(r['engine']['bytes']):>12} {h(r['stage_store']['bytes']):>12} "
              f"{h(r['prefetched']['bytes']):>12} {h(r['runs']['bytes']):>10} {h(r['total_bytes']):>12}")
        print(f"{'':<24} {r['engine']['releases']} release(s), {r['engine']['tags']} tag(s); "
              f"{r['stage_store']['stages']} stage(s) in {r['stage_store']['path']}; {r['runs']['count']} run(s)"
              + mark)
    if doc.get("other_images"):
        print(f"+ {doc['other_images']} image(s) of other checkouts in the shared stage store (imagebuild df --all)")
    if doc["buildkit_cache"]:
        print(f"BuildKit build cache: {h(doc['buildkit_cache']['bytes'])} (docker builder prune frees it)")
    print(f"git mirror cache: {h(doc['git_mirrors']['bytes'])} in {doc['git_mirrors']['path']}")
    for cc in doc.get("compiler_caches", []):
        print(f"compiler cache {cc['id']}: {h(cc['bytes'])} in {cc['path']}")
    return EXIT_OK


def cmd_patch(args) -> int:
    from imagebuild.build import builder as build_mod

    ctx = common.ctx(args)
    try:
        doc = build_mod.patch(ctx, args.image, args.src, check=args.check, stage=args.stage)
    except build_mod.PatchFailed as exc:
        if args.json:
            common.print_json(exc.doc)
        else:
            _print_patches(exc.doc)
        raise
    if args.json:
        common.print_json(doc)
    else:
        _print_patches(doc)
    return EXIT_OK


def _print_patches(doc) -> None:
    for p in doc["patches"]:  # every failing patch's reason, not the first one's alone (the error says that)
        print(f"{p['outcome']:<16} {p['patch']}" + ((f"  ({p['message']})" if p["outcome"] != "failed" else
                                                    f"\n  {p['message']}") if p["message"] else ""))


def _cmd_gc_peer(args) -> int:
    from imagebuild.ship import peergc

    if args.image:
        raise UsageError("gc --peer cleans a peer's sync cache: it takes no IMAGE")
    keep = peergc.DEFAULT_KEEP if args.keep is None else args.keep
    if keep < 0:
        raise UsageError(f"--keep {keep}: expected 0 or more")
    results = [peergc.gc_peer(host, keep=keep, dry_run=args.dry_run) for host in dict.fromkeys(args.peer)]
    if args.json:
        common.print_json({"schema": "imagebuild.gc-peer", "version": 1, "dry_run": args.dry_run,
                     "peers": [r.as_dict() for r in results]})
    else:
        for r in results:
            print(peergc.render(r, args.dry_run))
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAILED


# ------------------------------------------------------------------------------------------------ sync


def cmd_sync(args) -> int:
    from imagebuild.ship import sync as sync_mod

    ctx = common.ctx_or_none(args)
    reg = None
    if args.via == "registry":
        from imagebuild.core import registry as registry_mod

        value = args.registry or (ctx.config.registry if ctx is not None else None)
        if not value:
            raise UsageError("sync --via registry: which registry? none given and imagebuild.yaml has no registry:",
                             hint="imagebuild sync --via registry --registry HOST:PORT/PREFIX PEER...")
        reg = registry_mod.parse(value, what="--registry" if args.registry else "imagebuild.yaml: registry")
    elif args.registry or args.tunnel is not None:
        raise UsageError("--registry and --tunnel go with --via registry")
    delivery = None
    if reg is not None:
        from imagebuild.ship import registry_sync

        delivery = registry_sync.delivery(reg, args.tunnel)
    sync_mod.image_named_as_peer(ctx, args.peers)
    if args.image is None and ctx is not None and len(defn_mod.list_images(ctx.root)) > 1:
        return _sync_promoted(args, ctx, delivery)
    report = sync_mod.sync(ctx, args.peers, image=args.image, jobs=args.jobs, force=args.force,
                           dry_run=args.dry_run, delivery=delivery)
    if args.json:
        common.print_json(report.as_dict())
    else:
        print(sync_mod.render(report))
    return report.exit_code


def _sync_promoted(args, ctx, delivery) -> int:
    """``imagebuild sync PEER...`` without --image in a project of several definitions: every promoted
    ``:local`` (sync_mod.promoted), one sync each; each report, then one line per definition. The
    exit code is the worst of the syncs; 1 when nothing is promoted."""
    from imagebuild.core.errors import OperationFailed
    from imagebuild.ship import sync as sync_mod

    sync_mod.resolve_peers(ctx, args.peers)  # exit 2 for no peer, before any image is looked at
    rows, reports = [], []
    for name, why in sync_mod.promoted(ctx):
        if why is not None:
            rows.append((name, "skipped", why))
            continue
        report = sync_mod.sync(ctx, args.peers, image=name, jobs=args.jobs, force=args.force,
                               dry_run=args.dry_run, delivery=delivery)
        reports.append(report)
        if not args.json:
            print(sync_mod.render(report) + "\n")
        peers = ", ".join(f"{p.peer} {p.status}" for p in report.peers)
        rows.append((name, "ok" if report.ok else "not synced", f"{report.ref}: {peers}"))
    if not reports:
        raise OperationFailed("nothing to sync: no definition of this project has a promoted :local here ("
                              + "; ".join(f"{n}: {w}" for n, _, w in rows) + ")",
                              hint="imagebuild build IMAGE (it promotes a gated build), or imagebuild sync "
                              "--image IMAGE|REF PEER")
    code = max(r.exit_code for r in reports)
    if args.json:
        common.print_json({"schema": "imagebuild.sync-promoted", "version": 1, "exit_code": code,
                           "images": [{"image": n, "status": st, "detail": d} for n, st, d in rows],
                           "reports": [r.as_dict() for r in reports]})
        return code
    for name, st, detail in rows:
        print(f"{name}: {st}: {detail}")
    return code


def cmd_rollback(args) -> int:
    from imagebuild.build import promote as promote_mod

    ctx = common.ctx(args)
    _rollback_target(args.image, ctx)
    if args.registry is not None:
        return _rollback_registry(args, ctx)
    doc = promote_mod.rollback(args.image, ctx, dry_run=args.dry_run)
    if args.json:
        common.print_json(doc)
    else:
        would = "would move " if args.dry_run else ""
        print(f"{args.image}:local    {would}-> {short_digest(doc['local_id'])}"
              + (f"  (from {short_digest(doc['previous_id'])})" if args.dry_run and doc["previous_id"] else ""))
        if doc["previous_id"]:
            print(f"{args.image}:previous {would}-> {short_digest(doc['previous_id'])}")
        if args.dry_run:
            print("dry run: no tag moved")
    return EXIT_OK


def _rollback_target(image: str, ctx) -> None:
    """rollback takes a definition name (it swaps IMAGE:local and IMAGE:previous): not a reference
    (``img:local`` would look for ``img:local:previous``), not a path, not a repository this project
    has no definition of (exit 2, as docs/cli.md says)."""
    if ":" in image or "@" in image:
        name = image.split("@", 1)[0].rsplit(":", 1)[0]
        raise UsageError(f"rollback {image}: expected an image name, not a reference: rollback swaps NAME:local "
                         "and NAME:previous", hint=f"imagebuild rollback {name}")
    defn_mod.check_image_name(image)
    if not (ctx.root / defn_mod.IMAGES_DIR / image / defn_mod.IMAGE_FILE).is_file():
        raise defn_mod.unknown_image(ctx.root, image, note="rollback swaps the tags of this project's images only")


def _rollback_registry(args, ctx) -> int:
    from imagebuild.build import registry_release
    from imagebuild.core import registry as registry_mod

    value = args.registry or ctx.config.registry
    if not value:
        raise UsageError("rollback --registry: which registry? none given and imagebuild.yaml has no registry:",
                         hint="imagebuild rollback IMAGE --registry HOST:PORT/PREFIX")
    reg = registry_mod.parse(value, what="--registry" if args.registry else "imagebuild.yaml: registry")
    doc = registry_release.rollback(reg, args.image, ctx, dry_run=args.dry_run)
    if args.json:
        common.print_json(doc)
    else:
        would = "would move " if args.dry_run else ""
        print(f"{reg.repo(args.image)}:local    {would}-> {short_digest(doc['local_digest'])}  "
              f"(identity {short_digest(doc['local_identity'])})")
        if doc["previous_digest"]:
            print(f"{reg.repo(args.image)}:previous {would}-> {short_digest(doc['previous_digest'])}")
        if args.dry_run:
            print("dry run: no tag moved")
    return EXIT_OK


def cmd_config(args) -> int:
    from imagebuild.ops import settings

    env_root = os.environ.get("IMAGEBUILD_ROOT")
    origin = "environment" if env_root and args.root == env_root else "flag" if args.root else "default"
    try:
        root = common.root(args)
    except UsageError:
        if args.root:  # an explicit root that is no project is an error, as for every command
            raise
        root, origin = None, "default"
    from imagebuild.core import config as config_mod

    cfg = config_mod.load(root)
    rows = settings.effective(root, origin, cfg)
    env = settings.environment()
    if args.json:
        common.print_json({"schema": "imagebuild.config", "version": 1, "settings": [r.as_dict() for r in rows],
                           "environment": env if args.env else [e for e in env if e["set"]]})
        return EXIT_OK

    def value(v) -> str:
        if v is None:
            return "none"
        if isinstance(v, list):
            return ", ".join(v) or "none"
        if isinstance(v, dict):
            return "; ".join(f"@{k}: {', '.join(h)}" for k, h in v.items()) or "none"
        return printable(str(v), keep="")

    w = max(len(r.name) for r in rows)
    vw = min(60, max(len(value(r.value)) for r in rows))
    for r in rows:
        print(f"{r.name:<{w}}  {value(r.value):<{vw}}  {r.origin}" + (f" ({r.via})" if r.via else ""))
    listed = env if args.env else [e for e in env if e["set"]]
    print(f"\nenvironment: {sum(e['set'] for e in env)} of the {len(env)} variables imagebuild reads are set"
          + ("" if args.env else " (imagebuild config --env lists them all; docs/cli.md, 'Environment variables')"))
    if listed:
        nw = max(len(e["name"]) for e in listed)
        for e in listed:
            print(f"  {e['name']:<{nw}}  " + (f"= {e['value']}" if e["set"] else f"   {e['what']}"))
    return EXIT_OK


def cmd_help(args) -> int:
    if not args.topic:
        build_parser().print_help()
        return EXIT_OK
    parser = build_parser(only=args.topic)
    commands = _command_parsers(parser)
    if args.topic not in commands:
        _unknown_command(parser, args.topic, commands)
    commands[args.topic].print_help()
    return EXIT_OK


def _unknown_command(parser, word: str, commands) -> None:
    """Exit 2: ``word`` is no command; the closest ones suggested."""
    import difflib

    close = difflib.get_close_matches(word, list(commands), n=3, cutoff=0.6)
    parser.error(f"unknown command {word[:40]!r}" + (f": did you mean {' or '.join(close)}?" if close else "")
                 + " (imagebuild help lists the commands)")


# ------------------------------------------------------------------------------------------------ main


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, with a suggestion for an unknown command or option and -v/-q refused together (exit 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    word = _command_in(argv)
    commands = _command_parsers(parser)
    if word and commands and word not in commands:
        _unknown_command(parser, word, commands)
    if word == "prefetch":  # the old spelling of one source's refresh (--refresh takes no value now)
        argv = [("--refresh-source=" + a.split("=", 1)[1]) if a.startswith("--refresh=") else a for a in argv]
    args, extra = parser.parse_known_args(argv)
    sp = _command_parsers(parser).get(getattr(args, "command", None), parser)
    if extra:
        msg = f"unrecognized arguments: {' '.join(extra)}"
        known = [o for a in sp._actions for o in a.option_strings if o.startswith("--")]
        for tok in extra:
            name = tok.split("=", 1)[0]
            starts = [o for o in known if name.startswith("--") and o.startswith(name)]
            if starts:
                msg += f" (options are never abbreviated: did you mean {' or '.join(starts)}?)"
                break
            import difflib

            close = difflib.get_close_matches(name, known, n=2, cutoff=0.75) if name.startswith("--") else []
            if close:  # a typo (--histroy)
                msg += f" (did you mean {' or '.join(close)}?)"
                break
        sp.error(msg)
    if args.verbose and args.quiet:
        sp.error("-v/--verbose and -q/--quiet cannot be used together")
    return args


def _command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def main(argv: Sequence[str] | None = None) -> int:
    entry = argv is None  # the process's own entry point (console script, python -m); tests pass argv
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=_command_in(argv))
    if not _command_in(argv) and not any(a in ("-h", "--help", "--version") for a in argv):
        parser.print_help()  # bare `imagebuild` (or only global options): the help, exit 2 (docs/cli.md)
        return EXIT_BAD_INPUT
    args = _parse(parser, argv)
    try:
        args.json_lines = _json_lines(args)
    except ImagebuildError as exc:  # a bad IMAGEBUILD_PROGRESS: said the usual way
        print(_verdicts(exc.render(), sys.stderr), file=sys.stderr)
        return exc.exit_code
    _setup_logging(args)
    # SIGINT, SIGTERM and SIGHUP end the run like Ctrl-C (every ``finally`` runs, exit 130); the ones
    # that follow the first are swallowed, so they cannot cut its cleanup short (core/interrupts.py)
    old_handlers = interrupts.install()
    try:
        return _dispatch(args, entry)
    finally:
        if not entry:  # an in-process caller gets its own handlers back
            interrupts.restore(old_handlers)


def _dispatch(args: argparse.Namespace, entry: bool) -> int:
    try:
        return args.func(args)
    except ImagebuildError as exc:
        if args.debug:
            traceback.print_exc()
        _say(args, "error", exc.render() if getattr(args, "json_lines", False) else
             _verdicts(exc.render(), sys.stderr))
        return exc.exit_code
    except KeyboardInterrupt:
        if entry:  # the cleanup is done: no late signal may turn this 130 into a death by signal
            interrupts.ignore_until_exit()
        _say(args, "error", "interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:  # a bug: say so plainly, with the traceback behind --debug
        if args.debug:
            traceback.print_exc()
        _say(args, "error", f"internal error: {type(exc).__name__}: {exc}\n  (rerun with --debug for the "
             "traceback; please report it)")
        return EXIT_FAILED


__all__ = ["main", "build_parser", "EXIT_REFUSED", "EXIT_GATE_FAILED", "EXIT_FAILED"]
