"""``imagebuild config``: the settings a command would use here, each with where it came from, and
every environment variable imagebuild reads (docs/cli.md, "Environment variables": the same list;
tests/unit/ops/test_settings.py keeps the code, this list and that table in step).

Reads only: nothing is made, no engine or peer is asked.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import state as state_mod

# (name, what it sets): every variable the code reads. Secrets are never shown (SECRET).
VARIABLES: tuple[tuple[str, str], ...] = (
    ("IMAGEBUILD_ROOT", "project root (default: the nearest folder at or above the current one holding docker-images/)"),
    ("IMAGEBUILD_STATE_DIR", "state folder: run records, logs, receipts, reports (default <root>/.imagebuild)"),
    ("IMAGEBUILD_STAGES", "the stage store, shared by the checkouts of this host (default $XDG_CACHE_HOME/imagebuild/stages)"),
    ("IMAGEBUILD_COMPILER_CACHE", "the compile stages' compiler caches, shared by the checkouts of this host (default "
     "$XDG_CACHE_HOME/imagebuild/compiler-cache)"),
    ("IMAGEBUILD_CACHE", "prefetch's git mirror cache (default $XDG_CACHE_HOME/imagebuild/git; --cache overrides it)"),
    ("IMAGEBUILD_LOCK_DIR", "build locks, one per engine and image (default <tmp>/imagebuild-locks)"),
    ("XDG_CACHE_HOME", "the folder imagebuild's caches live under (default ~/.cache)"),
    ("XDG_CONFIG_HOME", "the folder the default allowed-signers file lives under (default ~/.config)"),
    ("IMAGEBUILD_SIGNING_KEY", "gate: the SSH key that signs receipts (none: unsigned; default ~/.ssh/id_ed25519 when it exists)"),
    ("IMAGEBUILD_ALLOWED_SIGNERS", "gate --check-receipt, sync's peer: the allowed-signers file that receipts must verify against (none: off)"),
    ("GITHUB_ACTIONS", "nightly: true under a CI runner (GitHub Actions, Forgejo, Gitea): folds and ::error lines"),
    ("GITHUB_OUTPUT", "nightly: the CI runner's output file, where tonight's report paths are appended"),
    ("IMAGEBUILD_MIN_FREE_GB", "GiB that must stay free for a build (default 10)"),
    ("IMAGEBUILD_SERVING_COMMANDS", "globs on a container's command that mark it serving (build refuses, exit 3)"),
    ("IMAGEBUILD_SERVING_LABELS", "label keys or key=value that mark a container serving (default imagebuild.role=serve)"),
    ("IMAGEBUILD_SERVING_NAMES", "globs on container names that mark a container serving (default none)"),
    ("IMAGEBUILD_SERVING_IMAGES", "globs on image references that mark a container serving (default none)"),
    ("MAX_JOBS", "build: replaces the computed MAX_JOBS of the stages that declare it"),
    ("NVCC_THREADS", "build: replaces the computed NVCC_THREADS of the stages that declare it"),
    ("IMAGEBUILD_PROGRESS", "build, nightly: default for --progress (auto, tty, plain, quiet, rawjson)"),
    ("BUILDKIT_PROGRESS", "build, nightly: default for --progress when IMAGEBUILD_PROGRESS is not set (as for buildx)"),
    ("IMAGEBUILD_HEARTBEAT_S", "seconds between heartbeat lines: build off a terminal and prefetch's git fetches (default 30; 0: none)"),
    ("IMAGEBUILD_GIT_RETRIES", "prefetch: attempts per network git operation (default 5)"),
    ("IMAGEBUILD_RETRY_DELAY", "prefetch: first backoff delay in seconds, doubling (default 1)"),
    ("IMAGEBUILD_GIT_TIMEOUT", "prefetch: seconds per git network attempt (default 1800)"),
    ("IMAGEBUILD_GITHUB_API", "prefetch: base URL of the GitHub API asked for PR states (default GitHub's own)"),
    ("GITHUB_TOKEN", "optional GitHub API token for PR states (never shown, never in a report)"),
    ("GH_TOKEN", "redacted from nightly reports and kept from the --notify command (never used otherwise)"),
    ("IMAGEBUILD_GITHUB_TOKEN", "redacted from nightly reports and kept from the --notify command (never used otherwise)"),
    ("IMAGEBUILD_CARGO_CONFIG", "prefetch: the cargo config that names the crates registry (a sparse index or a directory source; default $CARGO_HOME/config.toml, then ~/.cargo/config.toml)"),
    ("CARGO_HOME", "prefetch: where the machine's cargo config is read from when IMAGEBUILD_CARGO_CONFIG is unset (default ~/.cargo)"),
    ("CARGO_HTTP_TIMEOUT", "prefetch: seconds per crate download (default 30)"),
    ("CARGO_NET_RETRY", "prefetch: retries per crate download (default 2)"),
    ("RUSTUP_DIST_SERVER", "prefetch: the server (or mirror) holding Rust's dist/ for a source with rust_toolchain: dist (no default)"),
    ("IMAGEBUILD_NO_GPU", "gate: 1 runs without GPUs even where the host has them"),
    ("IMAGEBUILD_NOTIFY", "nightly: default for --notify (a command run with the report's path)"),
    ("IMAGEBUILD_SSH", "the ssh command for peers and ssh:// engines (default ssh), e.g. 'ssh -F ~/.ssh/cluster'"),
    ("IMAGEBUILD_SSH_MUX", "sync: 0 turns off the shared ssh connection per peer"),
    ("IMAGEBUILD_SYNC_COMPRESS", "sync: auto (default) | none | zstd[:LEVEL], compression on the wire"),
    ("IMAGEBUILD_SYNC_CIPHERS", "sync: ssh ciphers preference (empty: ssh's own)"),
    ("IMAGEBUILD_SYNC_TIMEOUT", "sync: seconds bounding every remote step (default 120 s probe, 300 s short steps, 600 s + 1 s per 10 MB for a load or pull)"),
    ("IMAGEBUILD_SYNC_HEARTBEAT", "sync: seconds between the lines while a peer loads or pulls (default 30; 0: none)"),
    ("IMAGEBUILD_SYNC_LOCK_WAIT", "sync: seconds to wait for another sync of the image to the peer (default 1800), then busy (exit 3)"),
    ("IMAGEBUILD_SYNC_SOURCE", "sync: save reads the image with docker save even where the content store is readable"),
    ("IMAGEBUILD_CONTENT_STORE", "sync: more folders of blobs by digest (a containerd content store's blobs/sha256)"),
    ("IMAGEBUILD_SYNC_TUNNEL", "sync --via registry: 1 always through an ssh tunnel, 0 never (default: loopback only)"),
    ("IMAGEBUILD_PEER_MIN_FREE_GB", "sync: GiB that must stay free on the peer (default 1)"),
    ("IMAGEBUILD_PEER_CACHE", "on a peer: its sync cache (default $XDG_CACHE_HOME/imagebuild/peer)"),
    ("IMAGEBUILD_REGISTRY_INSECURE", "1: plain HTTP to a registry that is not on loopback"),
    ("IMAGEBUILD_SYNC_PAUSE", "test hook: sync stops before the named phases (transfer, load, ...)"),
    ("IMAGEBUILD_SYNC_STREAM", "sync: 0 waits for every blob before a containerd peer's load starts (default 1: it starts with the transfer)"),
    ("IMAGEBUILD_SYNC_WAIT_SHARED", "sync: 0 does not wait for another image's sync that sends blobs this one needs too (default 1: it waits, then sends only what is missing)"),
    ("IMAGEBUILD_REGISTRY_HOLD", "test hook: before-pull:STAGE:FILE waits while FILE exists"),
    ("DOCKER_HOST", "the engine (as for the docker CLI); build --engine overrides it"),
    ("DOCKER_CONTEXT", "the docker context (as for the docker CLI)"),
    ("DOCKER_CONFIG", "the docker CLI's config folder (current context, registry credentials)"),
    ("NO_COLOR", "no colour in output"),
    ("TERM", "build: dumb makes --progress auto plain even on a terminal"),
    ("COLUMNS", "width of --help text"),
)
SECRET = frozenset({"GITHUB_TOKEN", "GH_TOKEN", "IMAGEBUILD_GITHUB_TOKEN"})

ORIGINS = ("flag", "environment", "imagebuild.yaml", "default")


@dataclass(frozen=True)
class Setting:
    name: str
    value: object  # a path or text, a list (peers), a mapping (peer lists), or None (not set)
    origin: str  # one of ORIGINS
    via: str | None = None  # the flag, variable or key it came from

    def as_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "origin": self.origin, "via": self.via}


def _env_path(var: str, default: Path, default_via: str | None = None) -> Setting:
    v = os.environ.get(var)
    if v:
        return Setting("", str(Path(v).expanduser()), "environment", var)
    return Setting("", str(default), "default", default_via)


def _named(name: str, s: Setting) -> Setting:
    return Setting(name, s.value, s.origin, s.via)


def effective(root: Path | None, root_origin: str, config=None) -> list[Setting]:
    """The settings for a project at ``root`` (None: outside any project), ``root_origin`` saying
    how the root was found (flag, environment, default); ``config``: its imagebuild.yaml
    (core.config.ProjectConfig) or None."""
    cache = state_mod.cache_home()
    xdg = "XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else None
    out = [Setting("root", str(root) if root else None, root_origin,
                   {"flag": "--root", "environment": "IMAGEBUILD_ROOT"}.get(root_origin))]
    cfg_path = getattr(config, "path", None)
    out.append(Setting("imagebuild.yaml", str(cfg_path) if cfg_path else None,
                       "imagebuild.yaml" if cfg_path else "default"))
    if root is not None:
        out.append(_named("state", _env_path("IMAGEBUILD_STATE_DIR", Path(root) / state_mod.STATE_DIRNAME)))
    else:
        out.append(Setting("state", None, "default"))
    out.append(_named("stage store", _env_path(state_mod.STAGES_ENV, cache / "imagebuild" / "stages", xdg)))
    out.append(_named("git mirror cache", _env_path("IMAGEBUILD_CACHE", cache / "imagebuild" / "git", xdg)))
    out.append(Setting("sync cache", str(cache / "imagebuild" / "sync"), "environment" if xdg else "default", xdg))
    out.append(_named("peer cache", _env_path("IMAGEBUILD_PEER_CACHE", cache / "imagebuild" / "peer", xdg)))
    out.append(_named("lock folder", _env_path("IMAGEBUILD_LOCK_DIR",
                                               Path(tempfile.gettempdir()) / "imagebuild-locks")))
    if xdg:  # the defaults above came from XDG_CACHE_HOME: that is an environment origin
        out = [Setting(s.name, s.value, "environment", s.via) if s.via == xdg else s for s in out]
    peers = tuple(getattr(config, "peers", ()) or ())
    out.append(Setting("peers", list(peers), "imagebuild.yaml" if peers else "default", "peers" if peers else None))
    lists = dict(getattr(config, "peer_lists", None) or {})
    out.append(Setting("peer lists", {k: list(v) for k, v in lists.items()},
                       "imagebuild.yaml" if lists else "default", "peer_lists" if lists else None))
    reg = getattr(config, "registry", None)
    out.append(Setting("registry", reg, "imagebuild.yaml" if reg else "default", "registry" if reg else None))
    for var, name in (("DOCKER_HOST", "engine"), ("DOCKER_CONTEXT", "docker context")):
        v = os.environ.get(var)
        if v or name == "engine":
            out.append(Setting(name, _shown(v) if v else "the docker CLI's own (local socket or its current context)",
                               "environment" if v else "default", var if v else None))
    ssh = os.environ.get("IMAGEBUILD_SSH")
    out.append(Setting("ssh", _shown(ssh) if ssh else "ssh", "environment" if ssh else "default",
                       "IMAGEBUILD_SSH" if ssh else None))
    return out


def _shown(value: str) -> str:
    """A value as ``config`` shows it: one line of printable text, no URL's ``user:password@``."""
    from imagebuild.core.printable import one_line
    from imagebuild.core.secrets import without_userinfo

    return one_line(without_userinfo(value))


def environment() -> list[dict]:
    """Every variable of VARIABLES: whether it is set here and its value (secrets: never)."""
    rows = []
    for name, what in VARIABLES:
        v = os.environ.get(name)
        shown = None if v is None else ("(set, not shown)" if name in SECRET else _shown(v))
        rows.append({"name": name, "set": v is not None, "value": shown, "what": what})
    return rows
