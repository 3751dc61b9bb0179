"""Things made on first use rather than at import: regular expressions, modules, the logger.

Whatever a module compiles or imports at import time, every command that imports it pays, whether
it uses it or not (``--version`` must stay under 100 ms: docs/cli.md, "Start-up time"). A
module-level ``x = lazy.module("x")`` is a plain import that waits until ``x`` is first used.

- ``compile(pattern, flags)``: ``re.compile``'s signature; the pattern compiles the first time one
  of its methods is used.
- ``module(name)``: a stand-in for ``import name`` that imports on first attribute access.
- ``logger()``: the ``imagebuild`` logger, looked up on first use (``logging`` imported then);
  ``debugging()`` says whether it shows debug messages, without importing ``logging``.
"""

from __future__ import annotations

import re
import sys


class Pattern:
    __slots__ = ("_args", "_compiled")

    def __init__(self, pattern, flags: int = 0):
        self._args = (pattern, flags)
        self._compiled = None

    def _get(self) -> re.Pattern:
        if self._compiled is None:
            self._compiled = re.compile(*self._args)
        return self._compiled

    def match(self, *a):
        return self._get().match(*a)

    def fullmatch(self, *a):
        return self._get().fullmatch(*a)

    def search(self, *a):
        return self._get().search(*a)

    def sub(self, *a):
        return self._get().sub(*a)

    def __getattr__(self, name: str):  # finditer, findall, split, pattern, groupindex, ...
        return getattr(self._get(), name)

    def __repr__(self) -> str:
        return f"lazy.compile({self._args[0]!r})"


def compile(pattern, flags: int = 0) -> Pattern:  # noqa: A001 (re.compile's name, on purpose)
    return Pattern(pattern, flags)


class Module:
    """``import name`` (relative to ``package`` when it starts with '.') on first attribute access."""

    def __init__(self, name: str, package: str | None = None):
        self._name = name
        self._package = package
        self._module = None

    def __getattr__(self, attr: str):
        if self._module is None:
            import importlib

            self._module = importlib.import_module(self._name, self._package)
        return getattr(self._module, attr)


def module(name: str, package: str | None = None) -> Module:
    return Module(name, package)


class _Logger:
    def __getattr__(self, attr: str):
        import logging

        return getattr(logging.getLogger("imagebuild"), attr)


def logger() -> _Logger:
    """The "imagebuild" logger; ``log.info(...)`` etc. import logging only when first called."""
    return _Logger()


def debugging() -> bool:
    """Whether the "imagebuild" logger shows debug messages (-v, --debug), without importing logging:
    while nothing imported it, nothing asked for them (the CLI imports it at once for -v)."""
    logging = sys.modules.get("logging")
    return logging is not None and logging.getLogger("imagebuild").isEnabledFor(logging.DEBUG)
