"""Step 4, the build: a plan -> staged BuildKit builds, offline and reproducible, ending at a gated,
promoted image.

Takes a plan and the prefetched inputs, and gives stage images in the stage store (one OCI layout
per image, a ref per stage key), the release ``<image>:b-<build id>`` / ``:candidate``, and, once
the gate (``imagebuild.gate``) passed, ``:local`` moved with the old one kept as ``:previous``.
Entry points:
- ``builder``: ``build``, ``dry_run``, ``patch`` and their ``Options``;
- ``compilecache``: the compile stages' ccache, kept on the host (outlives BuildKit's cache mounts);
  ``compilecache_share``: the same cache through the build's registry, for a node without a host copy;
- ``guards``: the checks before anything runs (serving containers, architecture, the build lock);
- ``promote``: tags that never break the working image, and ``rollback``;
- ``buildlog``: what a failed stage's log says (its RUN's exit code, place and output);
- ``progress``: the ``--progress`` modes (``resolve_mode``) and BuildKit's lines decoded for them;
- ``shell``: ``imagebuild shell IMAGE STAGE``, a container of a stage's parent with its inputs;
- ``stagestore``: where built stages live; ``owners``: which checkout made which builds of it (gc
  of one clone leaves the others' alone); ``registry_release``: release tags in a shared registry
  (the registry stage cache, ``registry_cache``, is the builder's own).

Named ``buildstep``, not ``build``: tools take a folder named build for build output and skip it
(pytest's default norecursedirs, GitHub's Python .gitignore, code maps; docs/design.md).
"""


__all__ = ["builder", "buildlog", "compilecache", "compilecache_share", "guards", "owners", "progress", "promote",
           "registry_release", "shell", "stagestore"]
