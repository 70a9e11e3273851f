"""YAML loading that remembers where every value came from, so config errors name file, line and column.

Used by the cluster file loader now and by the policy engine later. Validation itself is pydantic's;
this module only maps an error's location (``("pools", 2, "memory_base_gb")``) back to the source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from dsec.errors import InvalidInput

M = TypeVar("M", bound=BaseModel)
Loc = tuple[str | int, ...]
MERGE_TAG = "tag:yaml.org,2002:merge"
MIN_NODES = 10_000  # a budget floor, so that small documents may use merge keys freely
MAX_DEPTH = 64


class ConfigError(InvalidInput, ValueError):
    """A config file is unreadable or invalid. ``str()`` is ``file:line:col: field: message`` per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class Marked:
    data: Any
    marks: dict[Loc, tuple[int, int]]  # location -> (line, column), both 1-based


class _Budget:
    """Bounds what a document may expand to, and carries the constructor that turns its scalars into values.

    An alias (``*name``) re-walks the node it names, so a few hundred bytes of nested aliases ("billion laughs")
    expand exponentially: every node walked is counted, and a document without aliases never walks more nodes than
    it has characters. Depth is bounded too (deep nesting means recursion)."""

    def __init__(self, text: str) -> None:
        self.left = MIN_NODES + 4 * len(text)
        self.constructor = yaml.constructor.SafeConstructor()

    def spend(self, node: yaml.Node, depth: int) -> None:
        self.left -= 1
        if self.left < 0:
            line, col = node.start_mark.line + 1, node.start_mark.column + 1
            raise ConfigError([f"<>:{line}:{col}: the document expands to too many values (nested aliases?)"])
        if depth > MAX_DEPTH:
            line, col = node.start_mark.line + 1, node.start_mark.column + 1
            raise ConfigError([f"<>:{line}:{col}: nested deeper than {MAX_DEPTH} levels"])


def _walk(
    node: yaml.Node,
    loc: Loc,
    marks: dict[Loc, tuple[int, int]],
    budget: _Budget,
    at: yaml.Mark | None = None,
) -> Any:
    budget.spend(node, len(loc))
    # A mapping value is located at its key ("line of the field"), anything else at its own start.
    mark = at or node.start_mark
    marks[loc] = (mark.line + 1, mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        # Merge keys (``<<: *base``) first, earlier sources winning, then explicit keys over them.
        for key_node, value_node in node.value:
            if key_node.tag != MERGE_TAG:
                continue
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for src in sources:
                if not isinstance(src, yaml.MappingNode):
                    line, col = src.start_mark.line + 1, src.start_mark.column + 1
                    raise ConfigError([f"<>:{line}:{col}: a merge key (<<) needs a mapping or a list of mappings"])
                own = marks[loc]
                for k, v in _walk(src, loc, marks, budget).items():
                    out.setdefault(k, v)
                marks[loc] = own
        explicit: set[Any] = set()
        for key_node, value_node in node.value:
            if key_node.tag == MERGE_TAG:
                continue
            key = _scalar(key_node, budget) if not isinstance(key_node, yaml.ScalarNode) else key_node.value
            if key in explicit:
                line = key_node.start_mark.line + 1
                raise ConfigError([f"<>:{line}:{key_node.start_mark.column + 1}: duplicate key {key!r}"])
            explicit.add(key)
            out[key] = _walk(value_node, (*loc, key), marks, budget, key_node.start_mark)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_walk(item, (*loc, i), marks, budget) for i, item in enumerate(node.value)]
    return _scalar(node, budget)


def _scalar(node: yaml.Node, budget: _Budget) -> Any:
    """A scalar (or a complex mapping key) as the safe loader would give it: int, float, bool, null, str."""
    try:
        return budget.constructor.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        line, col = node.start_mark.line + 1, node.start_mark.column + 1
        raise ConfigError([f"<>:{line}:{col}: {getattr(exc, 'problem', None) or exc}"]) from None


def load_marked(text: str, source: str = "<string>") -> Marked:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise ConfigError([f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}"]) from exc
    except RecursionError:  # PyYAML composes recursively: thousands of nested [ or { exhaust the stack
        raise ConfigError([f"{source}: invalid YAML: nested too deeply"]) from None
    if node is None:
        return Marked({}, {(): (1, 1)})
    marks: dict[Loc, tuple[int, int]] = {}
    try:
        data = _walk(node, (), marks, _Budget(text))
    except ConfigError as exc:
        raise ConfigError([p.replace("<>", source, 1) for p in exc.problems]) from None
    return Marked(data, marks)


def locate(marks: dict[Loc, tuple[int, int]], loc: Loc) -> tuple[int, int]:
    """The position of ``loc`` or of its nearest ancestor present in the file."""
    while loc not in marks and loc:
        loc = loc[:-1]
    return marks.get(loc, (1, 1))


def format_loc(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def validate(model: type[M], marked: Marked, source: str) -> M:
    try:
        return model.model_validate(marked.data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            line, col = locate(marked.marks, loc)
            problems.append(f"{source}:{line}:{col}: {format_loc(loc)}: {err['msg']}")
        raise ConfigError(problems) from None


def load_file(model: type[M], path: str | Path) -> M:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read: {exc.strerror}"]) from exc
    return validate(model, load_marked(text, str(p)), str(p))
