"""Loading: the file named by `--config` or $LAPSE_CONFIG, then LAPSE_* overrides, checked.

See the package's docstring for the override syntax; every problem becomes one
`ConfigError` line naming the key (and the override that set it).
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from lapse.config.errors import ConfigError
from lapse.config.schema import LapseConfig

CONFIG_ENV = "LAPSE_CONFIG"
ENV_PREFIX = "LAPSE_"
ENV_SEPARATOR = "__"


def load_config(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> LapseConfig:
    """Read, merge and validate the configuration; raise `ConfigError` on any problem.

    `env` defaults to `os.environ` (tests pass their own mapping).
    """
    environ = os.environ if env is None else env
    from_env = path is None and bool(environ.get(CONFIG_ENV))
    if path is None:
        path = environ.get(CONFIG_ENV) or None
    label = os.fspath(path) if path is not None else "environment"
    data = _read_file(Path(path), label, from_env) if path is not None else {}
    overrides = _env_overrides(environ)
    for override in overrides:
        _set(data, override.keys, override.value)
    try:
        return LapseConfig.model_validate(data)
    except ValidationError as exc:
        problems = [_describe(error, label, overrides) for error in exc.errors()]
        raise ConfigError(problems) from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys: PyYAML would silently keep the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable):
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_file(path: Path, label: str, from_env: bool) -> dict[str, Any]:
    origin = f" (from {CONFIG_ENV})" if from_env else ""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{label}: file not found{origin}"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError([f"{label}: cannot read{origin}: {reason}"]) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError([_yaml_problem(label, exc)]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [f"{label}: the top level must be a mapping of sections ({_keys(LapseConfig)})"]
        )
    return data


def _yaml_problem(label: str, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"{label}:{mark.line + 1}:{mark.column + 1}" if mark is not None else label
    return f"{where}: invalid YAML: {' '.join(str(problem).split())}"


@dataclass(frozen=True)
class _Override:
    name: str
    keys: tuple[str, ...]
    value: str | list[str] | None


def _env_overrides(environ: Mapping[str, str]) -> list[_Override]:
    overrides = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or ENV_SEPARATOR not in name:
            continue
        keys = tuple(name[len(ENV_PREFIX) :].lower().split(ENV_SEPARATOR))
        if not all(keys):
            raise ConfigError(
                [
                    f"{name}: malformed override name (use LAPSE_<SECTION>__<KEY>, "
                    "e.g. LAPSE_NATS__URL)"
                ]
            )
        shape = _override_shape(name, keys)
        text = environ[name]
        value: str | list[str] | None = text
        if shape == "list":
            value = [item.strip() for item in text.split(",") if item.strip()]
        elif shape == "optional" and text == "":
            value = None
        overrides.append(_Override(name, keys, value))
    return overrides


def _override_shape(name: str, keys: tuple[str, ...]) -> Literal["scalar", "optional", "list"]:
    """What an override may set, from the models: it must name one scalar or list of scalars."""
    model: type[BaseModel] = LapseConfig
    for depth, key in enumerate(keys):
        dotted = ".".join(keys[: depth + 1])
        field = model.model_fields.get(key)
        if field is None:
            raise ConfigError(
                [f"{name}: unknown setting {dotted!r} (expected one of: {_keys(model)})"]
            )
        inner, optional = _unwrap_optional(field.annotation)
        last = depth == len(keys) - 1
        if _is_model(inner):
            if last:
                raise ConfigError([f"{name}: {dotted!r} is a section; set one of its keys"])
            model = inner
            continue
        is_list = get_origin(inner) in (tuple, list)
        if is_list and any(_is_model(arg) for arg in get_args(inner)):
            raise ConfigError([f"{name}: {dotted!r} can only be set in the config file"])
        if not last:
            raise ConfigError([f"{name}: {dotted!r} has no keys below it"])
        if is_list:
            return "list"
        return "optional" if optional else "scalar"
    raise AssertionError("unreachable: keys is never empty")


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(get_args(annotation)) == 2:
            return args[0], True
    return annotation, False


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _keys(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def _set(data: dict[str, Any], keys: tuple[str, ...], value: object) -> None:
    for key in keys[:-1]:
        if data.get(key) is None:
            data[key] = {}
        child = data[key]
        if not isinstance(child, dict):
            return  # the file's own value is wrong; validation reports it there
        data = child
    data[keys[-1]] = value


# --- error messages ---------------------------------------------------------------------


def _describe(error: ErrorDetails, label: str, overrides: Sequence[_Override]) -> str:
    loc = tuple(error["loc"])
    where = label
    rest = loc
    for override in overrides:
        if loc[: len(override.keys)] == override.keys:
            where, rest = override.name, loc[len(override.keys) :]
            break
    blamed = where != label
    path = _path(rest)
    if path:
        where = f"{where}{path}" if path.startswith("[") else f"{where}: {path}"
    # A check across several keys of a section may have been tripped by an override.
    inside = [o.name for o in overrides if len(o.keys) > len(loc) and o.keys[: len(loc)] == loc]
    note = f" (overridden: {', '.join(inside)})" if inside and not blamed else ""
    return f"{where}: {_problem(error)}{note}"


def _path(loc: Sequence[int | str]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
            text += f".{part}" if text else part
        else:
            text += f"[{part!r}]"
    return text


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: object) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return _show(value)


_PROBLEMS: dict[str, Callable[[ErrorDetails], str]] = {
    "missing": lambda e: "required key is missing",
    "bool_parsing": lambda e: f"{_show(e['input'])} is not a boolean (use true or false)",
    "bool_type": lambda e: f"{_show(e['input'])} is not a boolean (use true or false)",
    "int_parsing": lambda e: f"{_show(e['input'])} is not a whole number",
    "int_type": lambda e: f"{_show(e['input'])} is not a whole number",
    "int_from_float": lambda e: f"{_show(e['input'])} is not a whole number",
    "float_parsing": lambda e: f"{_show(e['input'])} is not a number",
    "float_type": lambda e: f"{_show(e['input'])} is not a number",
    "string_type": lambda e: (
        f"{_show(e['input'])} is not text"
        + (" (quote it in YAML)" if isinstance(e["input"], bool | int | float) else "")
    ),
    "model_type": lambda e: f"expected a mapping of keys, got {_kind(e['input'])}",
    "dict_type": lambda e: f"expected a mapping, got {_kind(e['input'])}",
    "list_type": lambda e: f"expected a list, got {_kind(e['input'])}",
    "tuple_type": lambda e: f"expected a list, got {_kind(e['input'])}",
}


def _problem(error: ErrorDetails) -> str:
    kind = error["type"]
    if kind == "value_error":
        # Our validators write complete sentences; pydantic would prefix "Value error, ".
        return str(error.get("ctx", {}).get("error", error["msg"]))
    if kind == "extra_forbidden":
        parent = _model_at(tuple(error["loc"])[:-1])
        expected = f" (expected one of: {_keys(parent)})" if parent else ""
        return f"unknown key{expected}"
    if kind in _PROBLEMS:
        return _PROBLEMS[kind](error)
    message = error["msg"]
    if message.startswith("Input should"):
        return f"{_show(error['input'])} should{message.removeprefix('Input should')}"
    return f"{_show(error['input'])}: {message}"


def _model_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The model class at a validation-error location, for listing the keys it accepts."""
    current: Any = LapseConfig
    for part in loc:
        current, _ = _unwrap_optional(current)
        if isinstance(part, int):
            args = get_args(current)
            current = args[0] if args else None
        elif _is_model(current) and part in current.model_fields:
            current = current.model_fields[part].annotation
        else:
            return None
    current, _ = _unwrap_optional(current)
    return current if _is_model(current) else None
