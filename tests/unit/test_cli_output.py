"""`-o json|yaml|jsonpath=|custom-columns=` as kubectl prints them (lapse/cli/output.py,
lapse/cli/jsonpath.py): pure, on plain rows."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from lapse.cli.jsonpath import JsonPathError, parse, render
from lapse.cli.output import OBJECT_FORMATS, Column, emit, output_format

ROWS = [
    {"name": "a", "n": 1, "targets": {"kubernetes": {"policy": "p"}}, "tags": ["x", "y"]},
    {"name": "b", "n": 2, "targets": {}, "tags": []},
]
LIST = {"apiVersion": "v1", "kind": "List", "items": ROWS}


def _emit(fmt: str, *, headers: bool = True) -> str:
    out = io.StringIO()
    args = argparse.Namespace(output=fmt, no_headers=not headers, watch=False)
    emit(ROWS, [Column("NAME", lambda r: r["name"])], args, out, name=lambda r: r["name"])
    return out.getvalue()


def test_json_and_yaml_are_a_kubectl_list() -> None:
    assert json.loads(_emit("json")) == LIST
    assert _emit("yaml").startswith("apiVersion: v1\nkind: List\nitems:\n")


def test_the_bare_array_is_kept_until_0_3_and_said_deprecated(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LAPSE_BARE_LISTS", "true")
    assert json.loads(_emit("json")) == ROWS
    assert "deprecated" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("template", "printed"),
    [
        ("{.items[*].name}", "a b"),
        ('{range .items[*]}{.name}{"\\t"}{.n}{"\\n"}{end}', "a\t1\nb\t2\n"),
        ("{.items[0].targets.kubernetes.policy}", "p"),
        ("{.items[?(@.n>1)].name}", "b"),
        ("{.items[?(@.name=='a')].tags[*]}", "x y"),
        ("{.items[-1:].name}", "b"),
        ("{..policy}", "p"),
        ("{.items[1].targets}", "{}"),
        ("names: {.items[*]['name']}", "names: a b"),
        ("{.kind}", "List"),
    ],
)
def test_jsonpath_is_kubectls(template: str, printed: str) -> None:
    assert render(template, LIST) == printed
    assert _emit(f"jsonpath={template}") == printed


@pytest.mark.parametrize("template", ["{.a", "{range .items[*]}{.name}", "{end}", "{.a[}"])
def test_a_template_that_does_not_parse_is_a_usage_error(template: str) -> None:
    with pytest.raises(JsonPathError):
        parse(template)
    with pytest.raises(argparse.ArgumentTypeError):
        output_format(OBJECT_FORMATS)(f"jsonpath={template}")


def test_custom_columns_one_row_per_item() -> None:
    printed = _emit("custom-columns=NAME:.name,POLICY:.targets.kubernetes.policy,TAGS:.tags[*]")
    assert printed.splitlines() == [
        "NAME   POLICY   TAGS",
        "a      p        x,y",
        "b      <none>   <none>",
    ]
    assert _emit("custom-columns=N:{.name}", headers=False).splitlines() == ["a", "b"]
    with pytest.raises(argparse.ArgumentTypeError):
        output_format(OBJECT_FORMATS)("custom-columns=NAME")


def test_an_unknown_format_names_the_formats() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="jsonpath=TEMPLATE"):
        output_format(OBJECT_FORMATS)("jsonn")
