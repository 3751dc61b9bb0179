"""Project settings: ``<root>/imagebuild.yaml`` (optional). Pins never live here (versions.env).

    peers: [dgx4]          # nodes that `doctor` checks and `sync` copies images to
    peer_lists:            # named lists: `imagebuild sync @rack2`
      rack2: [dgx5, dgx6]
    registry: 10.0.0.5:5000/imagebuild   # shared stage cache and release tags (docs/fleet.md)
    receipts:              # signed gate receipts (docs/gate.md#signed-receipts)
      signing_key: ~/.ssh/id_ed25519           # the key `gate` signs with
      allowed_signers: ~/.config/imagebuild/allowed_signers   # set: only receipts they signed count

Unknown keys are errors with file, line and a suggestion, like every definition file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from imagebuild.core import lazy, yamlread
from imagebuild.core.errors import DefinitionError, Problem, excerpt
from imagebuild.core.fsutil import inside
from imagebuild.core.remote import is_destination

difflib = lazy.module("difflib")  # error hints only (validate reads imagebuild.yaml: tests/unit/cli/test_startup.py)
CONFIG_FILE = "imagebuild.yaml"
KEYS = ("peers", "peer_lists", "registry", "receipts")
RECEIPT_KEYS = ("signing_key", "allowed_signers")


@dataclass(frozen=True)
class ProjectConfig:
    peers: tuple[str, ...] = ()
    path: Path | None = None
    peer_lists: dict[str, tuple[str, ...]] | None = None
    registry: str | None = None  # HOST[:PORT][/PREFIX] (registry.py)
    # receipts: {signing_key, allowed_signers}: paths as written (``~`` expanded), relative to the project
    receipts: dict[str, Path] | None = None


class ConfigError(DefinitionError):
    """Problems in imagebuild.yaml (exit 2), titled by that file, not as an image definition."""

    def __init__(self, problems: list[Problem]):
        super().__init__(problems, what=CONFIG_FILE)


def _text(path: Path, shown: str) -> str:
    """The file as UTF-8 text, its size checked before it is read; a bad byte named by line and column."""
    try:
        size = path.stat().st_size
        if size > yamlread.MAX_BYTES:
            raise ConfigError([Problem(shown, f"is {size} bytes: larger than {yamlread.MAX_BYTES} bytes (1 MiB), "
                                       "the limit for a YAML file")])
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError([Problem(shown, f"cannot read: {exc.strerror or exc}")]) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError([Problem(shown, f"not valid UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}, "
                                   f"column {column})", line=line)]) from None


def load(root: Path | None) -> ProjectConfig:
    if root is None:
        return ProjectConfig()
    path = Path(root) / CONFIG_FILE
    shown = CONFIG_FILE
    if path.is_symlink() and not inside(path, root):
        raise ConfigError([Problem(shown, "is a symlink that leads outside the project: not read",
                                   hint="keep imagebuild.yaml in the project's root folder")])
    if path.exists() and not path.is_file():  # a folder is no file; a FIFO would hang the read
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise ConfigError([Problem(shown, f"is {kind}, expected a file", hint="imagebuild.yaml is a YAML file "
                                   "in the project's root folder")])
    if not path.is_file():
        return ProjectConfig()
    try:
        node = yamlread.load(_text(path, shown))
    except yamlread.YamlError as exc:
        raise ConfigError([Problem(shown, str(exc), line=exc.line)]) from None
    if node is None:
        return ProjectConfig(path=path)
    if not isinstance(node.value, dict):
        raise ConfigError([Problem(shown, "expected a mapping (e.g. 'peers: [dgx4]')", line=node.line)])
    problems = []
    for key, line in (node.key_lines or {}).items():
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            problems.append(Problem(shown, f"unknown key {excerpt(key)}", line=line, key=key,
                                    hint=f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(KEYS)}"))
    peers: list[str] = []
    if "peers" in node.value:
        pn = node.value["peers"]
        if not isinstance(pn.value, list) or not all(is_destination(p.value) for p in pn.value):
            problems.append(Problem(shown, "expected a list of SSH destinations (dgx4, user@host; none may start "
                                    "with '-' or hold white space)", line=pn.line, key="peers"))
        else:
            peers = [p.value for p in pn.value]
    lists: dict[str, tuple[str, ...]] = {}
    if "peer_lists" in node.value:
        ln = node.value["peer_lists"]
        if not isinstance(ln.value, dict):
            problems.append(Problem(shown, "expected a mapping of list names to host lists "
                                    "(peer_lists: {rack2: [dgx5, dgx6]})", line=ln.line, key="peer_lists"))
        else:
            for name, hosts in ln.value.items():
                if not isinstance(hosts.value, list) or not all(is_destination(h.value) for h in hosts.value):
                    problems.append(Problem(shown, "expected a list of SSH destinations (dgx4, user@host; none may "
                                            "start with '-' or hold white space)", line=hosts.line,
                                            key=f"peer_lists.{name}"))
                else:
                    lists[str(name)] = tuple(h.value for h in hosts.value)
    registry = None
    if "registry" in node.value:
        rn = node.value["registry"]
        if not isinstance(rn.value, str):
            problems.append(Problem(shown, "expected HOST[:PORT][/PREFIX] (registry: 10.0.0.5:5000/imagebuild)",
                                    line=rn.line, key="registry"))
        else:
            from imagebuild.core import registry as registry_mod
            from imagebuild.core.errors import UsageError

            try:
                registry = str(registry_mod.parse(rn.value, what="registry"))
            except UsageError as exc:
                problems.append(Problem(shown, exc.message, line=rn.line, key="registry", hint=exc.hint))
    receipts = _receipts(node.value.get("receipts"), shown, Path(root), problems)
    if problems:
        raise ConfigError(problems)
    return ProjectConfig(tuple(peers), path, lists, registry, receipts)


def _receipts(rn, shown: str, root: Path, problems: list) -> dict[str, Path] | None:
    """``receipts: {signing_key: PATH, allowed_signers: PATH}`` (gate/signing.py); None when absent."""
    if rn is None:
        return None
    if not isinstance(rn.value, dict):
        problems.append(Problem(shown, "expected a mapping (receipts: {signing_key: ~/.ssh/id_ed25519, "
                                "allowed_signers: PATH})", line=rn.line, key="receipts"))
        return None
    out: dict[str, Path] = {}
    for key, line in (rn.key_lines or {}).items():
        if key not in RECEIPT_KEYS:
            close = difflib.get_close_matches(key, RECEIPT_KEYS, n=1)
            problems.append(Problem(shown, f"unknown key {excerpt(key)}", line=line, key=f"receipts.{key}",
                                    hint=f"did you mean {close[0]!r}?" if close else
                                    f"allowed: {', '.join(RECEIPT_KEYS)}"))
    for key in RECEIPT_KEYS:
        if key not in rn.value:
            continue
        vn = rn.value[key]
        if not isinstance(vn.value, str) or not vn.value.strip():
            problems.append(Problem(shown, "expected a file path", line=vn.line, key=f"receipts.{key}"))
            continue
        out[key] = root / Path(vn.value).expanduser()  # an absolute path stays as it is
    return out
