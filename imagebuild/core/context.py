"""One command's context: where the project is, its settings, where state goes, the engine, and
how much to say. Made once by the CLI (or by a library caller) and passed down instead of a bare
project root, in the spirit of mkosi's ``Context``.

    ctx = Context.for_root(root)          # or context.of(root) where a caller still has a Path
    ctx.root, ctx.config                  # the project, imagebuild.yaml
    ctx.state, ctx.stages                 # .imagebuild/ (or $IMAGEBUILD_STATE_DIR), the stage store
    ctx.engine                            # EngineInfo, probed once on first use
    ctx.show(path)                        # a path as the user sees it: relative to the project
    ctx.progress                          # auto | tty | plain | quiet | rawjson, or None: the environment's (build's --progress)

Settings are read lazily: ``--version`` and ``list`` never pay for what they do not use.
"""

from __future__ import annotations

import os
from pathlib import Path

from imagebuild.core import state as state_mod


class Context:
    __slots__ = ("root", "progress", "verbose", "_config", "_engine")

    def __init__(self, root: Path, *, progress: str = "auto", verbose: bool = False):
        self.root = Path(root).resolve()
        self.progress = progress
        self.verbose = verbose
        self._config = None
        self._engine = None

    @classmethod
    def for_root(cls, root: Path | str, **kw) -> Context:
        return cls(Path(root), **kw)

    @property
    def config(self):
        """imagebuild.yaml (config.ProjectConfig), read on first use."""
        if self._config is None:
            from imagebuild.core import config

            self._config = config.load(self.root)
        return self._config

    @property
    def state(self) -> Path:
        """The project's state folder (records, logs, receipts, temporary files)."""
        return state_mod.state_dir(self.root)

    @property
    def stages(self) -> Path:
        """The shared stage store (stagestore.py)."""
        return state_mod.stages_dir()

    @property
    def engine(self):
        """The Docker engine's facts (engine.EngineInfo), probed once."""
        if self._engine is None:
            from imagebuild.core import engine

            self._engine = engine.probe()
        return self._engine

    def show(self, path: Path | str) -> str:
        """``path`` relative to the project when it is inside it, else as given (absolute)."""
        p = Path(path)
        try:
            rel = os.path.relpath(p, self.root)
        except ValueError:
            return str(p)
        return str(p) if rel.startswith("..") else Path(rel).as_posix()

    def __repr__(self) -> str:
        return f"Context(root={str(self.root)!r})"


def of(ctx_or_root: Context | Path | str) -> Context:
    """A Context from a Context or a project root (for library callers that hold a Path)."""
    return ctx_or_root if isinstance(ctx_or_root, Context) else Context.for_root(ctx_or_root)


def maybe(ctx_or_root: Context | Path | str | None) -> Context | None:
    """``of``, where no project is also an answer (``sync REF``, ``gate REF --spec``, ``doctor``
    outside a project)."""
    return None if ctx_or_root is None else of(ctx_or_root)
