"""One exception family; each class carries the exit code the CLI returns for it.

Only ``cli.main`` catches these. Everything else raises them with a message that names the
file, line or key, says what was expected, and (where it helps) a hint about what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

# Exit codes (documented in docs/cli.md). Keep in sync with the table there.
EXIT_OK = 0
EXIT_FAILED = 1  # an operation failed (docker, git, network, ...)
EXIT_BAD_INPUT = 2  # bad input or configuration: definition errors, bad flags
EXIT_REFUSED = 3  # refused by a guard (serving container, wrong arch, lock held, ...)
EXIT_GATE_FAILED = 4  # the image's gate ran and failed
EXIT_INTERRUPTED = 130  # Ctrl-C


def shown(text: str) -> str:
    """What imagebuild prints of a message: printable text (core/printable.py), no URL's
    ``user:password@`` (core/secrets.py), whatever a child process, a file or a variable put in it."""
    from imagebuild.core.printable import printable
    from imagebuild.core.secrets import without_userinfo

    return printable(without_userinfo(text))


class ImagebuildError(Exception):
    """Base of every error the CLI reports without a traceback."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def render(self) -> str:
        text = f"error: {self.message}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return shown(text)


class OperationFailed(ImagebuildError):
    """A step that was allowed to run did not succeed (exit 1)."""

    exit_code = EXIT_FAILED


class CommandFailed(OperationFailed):
    """A subprocess exited non-zero. Carries the command and the tail of its output."""

    def __init__(self, argv: list[str], returncode: int, output: str = "", *, hint: str | None = None):
        self.argv = list(argv)
        self.returncode = returncode
        self.output = output
        tail = "\n".join(output.strip().splitlines()[-20:])
        msg = f"command failed (exit {returncode}): {' '.join(argv)}"
        if tail:
            msg += "\n" + "\n".join("  | " + line for line in tail.splitlines())
        super().__init__(msg, hint=hint)


class UsageError(ImagebuildError):
    """Bad command-line use or configuration (exit 2)."""

    exit_code = EXIT_BAD_INPUT


EXCERPT_CHARS = 32


def excerpt(text: object, n: int = EXCERPT_CHARS) -> str:
    """``text`` as an error may quote it: escaped (``repr``) and cut at ``n`` characters, so that a
    file that is not what it should be (a secret, a binary) is never echoed whole."""
    s = text if isinstance(text, str) else repr(text)
    return repr(s) if len(s) <= n else repr(s[:n]) + "..."


@dataclass(frozen=True)
class Problem:
    """One problem in a definition: where it is, what is wrong, what to do."""

    file: str
    message: str
    line: int | None = None
    key: str | None = None
    hint: str | None = None

    def location(self) -> str:
        loc = self.file
        if self.line is not None:
            loc += f":{self.line}"
        if self.key:
            shown = self.key if len(self.key) <= EXCERPT_CHARS and self.key.isprintable() else excerpt(self.key)
            loc += f": {shown}"
        return loc

    def render(self) -> str:
        text = f"{self.location()}: {self.message}"
        if self.hint:
            text += f"\n    hint: {self.hint}"
        return text

    def as_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "key": self.key, "message": self.message, "hint": self.hint}


class DefinitionError(ImagebuildError):
    """One or more problems in an image definition (exit 2). All are reported at once."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, problems: list[Problem], *, image: str | None = None, what: str | None = None):
        self.problems = list(problems)
        self.image = image
        # ``what``: the file when it is no image definition (the project's imagebuild.yaml)
        what = what or (f"image definition '{image}'" if image else "image definition")
        n = len(self.problems)
        super().__init__(f"{what} has {n} problem{'s' if n != 1 else ''}")

    def render(self) -> str:
        lines = [f"error: {self.message}:"]
        lines += ["  " + p.render().replace("\n", "\n  ") for p in self.problems]
        return shown("\n".join(lines))


class GuardRefused(ImagebuildError):
    """A guard rail refused to start the operation (exit 3)."""

    exit_code = EXIT_REFUSED


class GateFailed(ImagebuildError):
    """The image's gate ran and at least one required check failed (exit 4)."""

    exit_code = EXIT_GATE_FAILED
