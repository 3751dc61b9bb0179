"""Step 3, prefetch: every input a build needs, fetched once, pinned and packed, so no stage needs
the network.

Takes a definition and its plan, and gives the lock (``lock.json``: every source by SHA, every
package by hash, base images by digest), pins written back into versions.env, and ``deps-src/<image>/``:
deterministic source tarballs (composed forks, FetchContent dependencies, submodules), wheels and
apt packages. Entry points:
- ``prefetch``: ``imagebuild prefetch`` (``prefetch``, ``PrefetchOptions``);
- ``packages``: base images, wheels and apt packages; the named contexts a stage gets from them;
- ``gitcache``: the local cache of bare mirrors that the build, gc and nightly also read;
- ``bundle``: one verified file carrying an image's prefetched inputs to a node without GitHub.
"""

__all__ = ["bundle", "gitcache", "packages", "prefetch"]
