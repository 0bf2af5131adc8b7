"""kubectl's JSONPath templates (`-o jsonpath=...`, and each column of `-o custom-columns`).

The dialect is kubectl's (https://kubernetes.io/docs/reference/kubectl/jsonpath/): text with
`{...}` expressions, `{range ...}...{end}`, quoted literals (`{"\\n"}`), and in an expression
`.field`, `['field']`, `[n]`, `[a:b]`, `[*]`, `..field` (recursive) and `[?(@.k=="v")]`
filters. Python's JSONPath libraries implement Goessner's `$` dialect without kubectl's
template layer (braces, range/end, literals); none ships in lapse's dependencies, and the
paths a listing needs are few, so the dialect is implemented here, pure, on plain data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class JsonPathError(ValueError):
    """A template that does not parse, with what and where."""


@dataclass(frozen=True)
class _Text:
    text: str


@dataclass(frozen=True)
class _Expr:
    path: str


@dataclass(frozen=True)
class _Range:
    path: str
    body: tuple[_Text | _Expr | _Range, ...]


Node = _Text | _Expr | _Range

_BRACES = re.compile(r"\{((?:\"(?:\\.|[^\"\\])*\"|'[^']*'|[^{}])*)\}")


def parse(template: str) -> tuple[Node, ...]:
    """The template's text, expressions and ranges; JsonPathError when it is not one."""
    tokens: list[tuple[str, str]] = []
    at = 0
    for match in _BRACES.finditer(template):
        if match.start() > at:
            tokens.append(("text", template[at : match.start()]))
        tokens.append(("expr", match.group(1).strip()))
        at = match.end()
    if at < len(template):
        tokens.append(("text", template[at:]))
    if any("{" in value or "}" in value for kind, value in tokens if kind == "text"):
        raise JsonPathError(f"unmatched brace in {template!r}")
    nodes, rest = _nodes(tokens, 0)
    if rest != len(tokens):
        raise JsonPathError(f"{{end}} without {{range}} in {template!r}")
    return nodes


def _nodes(tokens: list[tuple[str, str]], at: int) -> tuple[tuple[Node, ...], int]:
    found: list[Node] = []
    while at < len(tokens):
        kind, value = tokens[at]
        if kind == "text":
            found.append(_Text(value))
        elif value == "end":
            return tuple(found), at
        elif value.startswith("range "):
            body, end = _nodes(tokens, at + 1)
            if end >= len(tokens):
                raise JsonPathError(f"{{{value}}} without {{end}}")
            path = value.removeprefix("range ").strip()
            find(path, None)  # a path that does not parse fails here, before any data
            found.append(_Range(path, body))
            at = end
        elif value[:1] in ('"', "'"):
            found.append(_Text(_literal(value)))
        else:
            find(value, None)
            found.append(_Expr(value))
        at += 1
    return tuple(found), at


def _literal(quoted: str) -> str:
    if quoted[0] == "'":
        return quoted[1:-1]
    try:
        text: str = json.loads(quoted, strict=False)
    except ValueError as exc:
        raise JsonPathError(f"bad literal {quoted}: {exc}") from None
    return text


def render(template: str, data: Any) -> str:
    """The template filled from `data`, as `kubectl -o jsonpath=` prints it: the results of
    one expression joined by spaces, strings bare, the rest as JSON."""
    return "".join(_render(parse(template), data))


def _render(nodes: tuple[Node, ...], data: Any) -> Iterator[str]:
    for node in nodes:
        if isinstance(node, _Text):
            yield node.text
        elif isinstance(node, _Expr):
            yield " ".join(_show(v) for v in find(node.path, data))
        else:
            for value in find(node.path, data):
                yield from _render(node.body, value)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), default=str)


_STEP = re.compile(
    r"""\.\.(?P<deep>[\w-]+)
    | \.(?P<field>[\w-]+)
    | \[\s*(?P<quote>['"])(?P<key>.*?)(?P=quote)\s*\]
    | \[\s*(?P<star>\*)\s*\]
    | \[\s*(?P<slice>-?\d*\s*:\s*-?\d*)\s*\]
    | \[\s*(?P<index>-?\d+)\s*\]
    | \[\?\(\s*@(?P<fpath>[.\w\-\[\]'"]*)\s*(?:(?P<op>==|!=|<=|>=|<|>)\s*(?P<rhs>[^)]*?))?\s*\)\]
    | \.(?P<dot>$)""",
    re.X,
)


def find(path: str, data: Any) -> list[Any]:
    """Every value `path` (`.items[*].name`, `@`, `$.a`) selects in `data`."""
    text = path.strip()
    if text in ("@", "$", ".", ""):
        return [data]
    text = text.removeprefix("$").removeprefix("@")
    if not text.startswith((".", "[")):
        text = "." + text  # custom-columns take `metadata.name` as kubectl does
    values = [data]
    at = 0
    while at < len(text):
        match = _STEP.match(text, at)
        if match is None:
            raise JsonPathError(f"cannot parse {path!r} at {text[at:]!r}")
        values = [found for value in values for found in _step(match, value)]
        at = match.end()
    return values


def _step(match: re.Match[str], value: Any) -> list[Any]:
    if match["dot"] is not None:
        return [value]
    if match["deep"] is not None:
        return list(_deep(match["deep"], value))
    key = match["field"] if match["field"] is not None else match["key"]
    if key is not None:
        return [value[key]] if isinstance(value, dict) and key in value else []
    items = list(value.values()) if isinstance(value, dict) else value
    if not isinstance(items, list):
        return []
    if match["star"] is not None:
        return items
    if match["index"] is not None:
        index = int(match["index"])
        return [items[index]] if -len(items) <= index < len(items) else []
    if match["slice"] is not None:
        start, _, stop = match["slice"].partition(":")
        return items[int(start) if start.strip() else None : int(stop) if stop.strip() else None]
    return [item for item in items if _keeps(match, item)]


def _deep(key: str, value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        if key in value:
            yield value[key]
        for child in value.values():
            yield from _deep(key, child)
    elif isinstance(value, list):
        for child in value:
            yield from _deep(key, child)


def _keeps(match: re.Match[str], item: Any) -> bool:
    found = find(match["fpath"] or "@", item)
    if match["op"] is None:
        return bool(found)
    rhs = _operand(match["rhs"])
    for left in found:
        try:
            if _compare(left, match["op"], rhs):
                return True
        except TypeError:
            continue
    return False


def _operand(text: str) -> Any:
    text = text.strip()
    if text[:1] == "'" and text[-1:] == "'":
        return text[1:-1]
    try:
        return json.loads(text)
    except ValueError:
        return text


def _compare(left: Any, op: str, right: Any) -> bool:
    if op == "==":
        return bool(left == right)
    if op == "!=":
        return bool(left != right)
    if op == "<":
        return bool(left < right)
    if op == ">":
        return bool(left > right)
    if op == "<=":
        return bool(left <= right)
    return bool(left >= right)
