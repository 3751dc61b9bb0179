"""YAML read with line numbers, so definition errors can name the line.

``load(text)`` returns a tree of ``Node`` objects: ``.value`` is a dict (str -> Node), a list of
Node, or a scalar (str, int, float, bool, None); ``.line`` is the 1-based line of the node.
"""

from __future__ import annotations

from dataclasses import dataclass

from imagebuild.core import lazy

yaml = lazy.module("yaml")  # PyYAML, imported when a text is read (--version and --help need none)


@dataclass
class Node:
    value: object  # dict[str, Node] | list[Node] | a scalar
    line: int
    key_lines: dict[str, int] | None = None  # for mappings: key -> line of the key

    def plain(self) -> object:
        if isinstance(self.value, dict):
            return {k: v.plain() for k, v in self.value.items()}
        if isinstance(self.value, list):
            return [v.plain() for v in self.value]
        return self.value


# Bounds (docs/image-definition.md, "YAML"): a definition file is small and plain. Anchors and
# aliases are refused: nested aliases expand exponentially (9 levels took 2.4 GB and 90 s).
MAX_BYTES = 1 << 20
MAX_NODES = 100_000
MAX_DEPTH = 64


class YamlError(ValueError):
    def __init__(self, message: str, line: int | None):
        super().__init__(message)
        self.line = line


def _loader(text: str):
    """SafeLoader's composer, refusing anchors and aliases and bounding the node count and depth
    (without libyaml; the class is made on first use, as PyYAML is imported then)."""

    class _Loader(yaml.SafeLoader):
        def __init__(self, text: str):
            super().__init__(text)
            self._nodes = 0
            self._depth = 0

        def compose_node(self, parent, index):
            event = self.peek_event()
            line = event.start_mark.line + 1
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                what = f"alias *{event.anchor}" if isinstance(event, yaml.AliasEvent) else f"anchor &{event.anchor}"
                raise YamlError(f"YAML {what}: anchors and aliases are not supported here (a few nested aliases "
                                "expand to gigabytes); write the value out", line)
            self._nodes += 1
            if self._nodes > MAX_NODES:
                raise YamlError(f"more than {MAX_NODES} YAML nodes: a definition file is small "
                                f"(limit {MAX_NODES})", line)
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise YamlError(f"YAML nested more than {MAX_DEPTH} levels deep (limit {MAX_DEPTH})", line)
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

    return _Loader(text)


def _check_events(text: str) -> None:
    """With libyaml (C): the same refusals as ``_Loader``, from the event stream, before composing."""
    nodes = depth = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        if isinstance(event, (yaml.CollectionEndEvent, yaml.DocumentEndEvent, yaml.StreamEndEvent)):
            depth -= isinstance(event, yaml.CollectionEndEvent)
            continue
        if not isinstance(event, yaml.NodeEvent):
            continue
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent) or event.anchor:
            what = f"alias *{event.anchor}" if isinstance(event, yaml.AliasEvent) else f"anchor &{event.anchor}"
            raise YamlError(f"YAML {what}: anchors and aliases are not supported here (a few nested aliases "
                            "expand to gigabytes); write the value out", line)
        nodes += 1
        if nodes > MAX_NODES:
            raise YamlError(f"more than {MAX_NODES} YAML nodes: a definition file is small (limit {MAX_NODES})",
                            line)
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH - 1:
                raise YamlError(f"YAML nested more than {MAX_DEPTH} levels deep (limit {MAX_DEPTH})", line)


def _compose(text: str):
    if getattr(yaml, "__with_libyaml__", False):  # the C parser: several times faster to start and run
        _check_events(text)
        return yaml.compose(text, Loader=yaml.CSafeLoader)
    loader = _loader(text)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def load(text: str) -> Node | None:
    """The tree of ``text`` (None for an empty document); YamlError, with its line, when it is not
    YAML this project reads."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise YamlError(f"the file is {size} bytes: larger than {MAX_BYTES} bytes (1 MiB), the limit for a "
                        "definition file", None)
    return _load(text)


def _load(text: str) -> Node | None:
    try:
        root = _compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or str(exc)
        line = mark.line + 1 if mark else None
        if line is None and isinstance(getattr(exc, "position", None), int):  # a ReaderError (a bad character)
            line = text.count("\n", 0, exc.position) + 1
        raise YamlError(f"invalid YAML: {problem}", line) from None
    if root is None:
        return None
    return _convert(root)


def _convert(node) -> Node:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Node] = {}
        key_lines: dict[str, int] = {}
        for k, v in node.value:
            key = _scalar(k)
            if not isinstance(key, str):
                raise YamlError(f"mapping keys must be strings, got {key!r}", k.start_mark.line + 1)
            if key in out:
                raise YamlError(f"duplicate key {key!r}", k.start_mark.line + 1)
            out[key] = _convert(v)
            key_lines[key] = k.start_mark.line + 1
        return Node(out, line, key_lines)
    if isinstance(node, yaml.SequenceNode):
        return Node([_convert(v) for v in node.value], line)
    return Node(_scalar(node), line)


def _scalar(node) -> object:
    if not isinstance(node, yaml.ScalarNode):
        raise YamlError("expected a plain value here", node.start_mark.line + 1)
    constructor = _constructor()
    return constructor.construct_scalar(node) if node.tag.endswith(":str") else constructor.construct_object(node)


_CONSTRUCTOR = None


def _constructor():
    """Scalars only: a constructor needs no reader or scanner (a SafeLoader("") would run its reader)."""
    global _CONSTRUCTOR
    if _CONSTRUCTOR is None:
        _CONSTRUCTOR = yaml.constructor.SafeConstructor()
    return _CONSTRUCTOR
