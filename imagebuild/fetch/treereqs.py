"""The installed set against the composed trees' own requirements (image.yaml ``requirements.satisfies``).

The runner installs the built vLLM and b12x wheels ``--no-deps``: nothing makes the locked set meet
what those trees require, and a set kept from an older snapshot drifts silently. Prefetch reads the
named requirement files (``-r`` includes followed) out of each source's packed tarball, the bytes
the build gets, evaluates their markers for the definition's platform and Python, and checks each
requirement against the versions the stage and the stages above it install. A requirement that is
missing or not met is an error naming the tree's file and line, unless the stage lists the package
under ``requirements.exceptions`` with its reason; an exception nothing needs is a warning. The
gate's ``pip check`` then allows exactly those exceptions (docs/packages.md).
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from imagebuild.core.errors import DefinitionError, OperationFailed, Problem
from imagebuild.definition import pkgspec

MACHINES = {"linux/arm64": "aarch64", "linux/amd64": "x86_64", "linux/ppc64le": "ppc64le", "linux/s390x": "s390x"}


@dataclass(frozen=True)
class TreeRequirement:
    source: str
    file: str  # inside the tree
    line: int
    text: str
    req: Requirement


@dataclass(frozen=True)
class Finding:
    requirement: TreeRequirement
    installed: str | None  # the version the set installs, None: not installed
    excepted: str | None  # the exception's reason, when one covers it

    def shown(self) -> str:
        r = self.requirement
        got = f"the set installs {self.installed}" if self.installed else "the set does not install it"
        return f"{r.source}:{r.file}:{r.line}: {r.text} ({got})"


def target_environment(platform: str, python: str) -> dict:
    env = dict(default_environment())
    machine = MACHINES.get(platform, platform.split("/")[-1])
    env.update({"platform_machine": machine, "sys_platform": "linux", "platform_system": "Linux",
                "os_name": "posix", "python_version": python, "python_full_version": f"{python}.0",
                "implementation_name": "cpython", "platform_python_implementation": "CPython"})
    return env


def read_tree_requirements(tarball: Path, source: str, files: tuple[str, ...]) -> list[TreeRequirement]:
    """Every requirement line of ``files`` (and what they ``-r``-include) in the source's tarball."""
    out: list[TreeRequirement] = []
    seen: set[str] = set()
    try:
        tf = tarfile.open(tarball)
    except (OSError, tarfile.TarError) as exc:
        raise OperationFailed(f"{source}: cannot read {tarball}: {exc}", hint="run imagebuild prefetch again") from None
    with tf:
        def read(name: str, asked_by: str | None) -> None:
            norm = str(PurePosixPath(name))
            if norm in seen:
                return
            seen.add(norm)
            try:
                member = tf.extractfile("./" + norm)
            except KeyError:
                member = None
            if member is None:
                where = f" (included by {asked_by})" if asked_by else ""
                raise DefinitionError([Problem(f"{source}:{norm}", f"not in the composed tree{where}",
                                               hint="requirements.satisfies names files of the source tree")])
            for i, raw in enumerate(member.read().decode("utf-8", "replace").splitlines(), 1):
                line = raw.split(" #", 1)[0].split("\t#", 1)[0].strip()
                if not line or line.startswith("#"):
                    continue
                if line.startswith(("-r ", "--requirement ")):
                    inc = line.split(None, 1)[1].strip()
                    read(str(PurePosixPath(norm).parent / inc), f"{norm}:{i}")
                    continue
                if line.startswith("-"):
                    continue  # index options and constraints of the tree's own CI
                try:
                    req = Requirement(line)
                except InvalidRequirement:
                    continue  # a URL or local path requirement: not a version to compare
                out.append(TreeRequirement(source, norm, i, line, req))

        for f in files:
            read(f, None)
    return out


def check(reqs: list[TreeRequirement], installed: dict[str, str], exceptions: dict[str, str], env: dict
          ) -> tuple[list[Finding], list[Finding], list[str]]:
    """(problems, excepted, unused exception names) of ``reqs`` against ``installed`` (name -> version)."""
    problems, excepted, used = [], [], set()
    for r in reqs:
        if r.req.marker is not None and not r.req.marker.evaluate(env):
            continue
        name = pkgspec.normalise(r.req.name)
        have = installed.get(name)
        ok = False
        if have is not None:
            try:
                ok = r.req.specifier.contains(Version(have), prereleases=True)
            except InvalidVersion:
                ok = False
        if ok:
            continue
        if name in exceptions:
            used.add(name)
            excepted.append(Finding(r, have, exceptions[name]))
        else:
            problems.append(Finding(r, have, None))
    unused = sorted(n for n in exceptions if n not in used)
    return problems, excepted, unused


def refuse(stage: str, requirements_display: str, problems: list[Finding]) -> DefinitionError:
    items = [Problem(f"{p.requirement.source}:{p.requirement.file}", f"{p.requirement.text}: "
                     + (f"stage {stage!r} installs {pkgspec.normalise(p.requirement.req.name)}=={p.installed}"
                        if p.installed else f"stage {stage!r} installs no {p.requirement.req.name}"),
                     line=p.requirement.line, key=pkgspec.normalise(p.requirement.req.name),
                     hint=f"pin a version that meets it in {requirements_display}, or list it under the stage's "
                     "requirements.exceptions with the reason")
             for p in problems]
    return DefinitionError(items)
