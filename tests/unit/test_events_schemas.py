"""The JSON Schema files are exactly what the models generate, and events match them."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from lapse.events import EventType, build_event
from lapse.events.models import RunFinished
from lapse.events.schemas import (
    DIALECT,
    SCHEMA_DIR,
    generate_schema,
    load_schema,
    render_schema,
    schema_filename,
    stale_schemas,
    write_schemas,
)
from lapse.events.schemas.__main__ import main
from tests.unit.test_events_builder import make_run, sample_payloads


def test_schema_files_on_disk_equal_the_generated_ones() -> None:
    assert stale_schemas() == [], "run `python -m lapse.events.schemas` and commit the result"
    for event_type in EventType:
        path = SCHEMA_DIR / schema_filename(event_type)
        assert path.read_text("utf-8") == render_schema(event_type)
        assert load_schema(event_type) == generate_schema(event_type)


def test_check_mode_detects_drift_and_strays(tmp_path: Path) -> None:
    write_schemas(tmp_path)
    assert stale_schemas(tmp_path) == []
    drifted = tmp_path / schema_filename(EventType.CLEANUP_DUE)
    drifted.write_text(drifted.read_text().replace('"deadline"', '"deadLine"'))
    (tmp_path / "dev.lapse.cleanup.exploded.v1.json").write_text("{}")
    (tmp_path / schema_filename(EventType.RUN_DELETED)).unlink()
    assert stale_schemas(tmp_path) == sorted(
        [
            "dev.lapse.cleanup.due.v1.json",
            "dev.lapse.cleanup.exploded.v1.json",
            "dev.lapse.run.deleted.v1.json",
        ]
    )


def test_generator_check_passes_on_the_shipped_files() -> None:
    assert main(["--check"]) == 0


@pytest.mark.parametrize("event_type", list(EventType))
def test_schemas_are_valid_draft_2020_12(event_type: EventType) -> None:
    schema = load_schema(event_type)
    assert schema["$schema"] == DIALECT
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize(("event_type", "payload"), sample_payloads())
def test_built_events_validate_against_the_schema_file(
    event_type: EventType, payload: object
) -> None:
    event = build_event(event_type, source="/lapse/test", data=payload)  # type: ignore[arg-type]
    schema = json.loads((SCHEMA_DIR / schema_filename(event_type)).read_text("utf-8"))
    jsonschema.Draft202012Validator(schema).validate(event.get_data())


@pytest.mark.parametrize(
    ("event_type", "mutate"),
    [
        (EventType.RUN_FINISHED, lambda d: d.pop("run")),
        (EventType.RUN_FINISHED, lambda d: d.update(extra=1)),
        (EventType.RUN_FINISHED, lambda d: d["run"].update(engine="nomad")),
        (EventType.RUN_FINISHED, lambda d: d["run"].update(uid="")),
        (EventType.CLEANUP_COMPLETED, lambda d: d.update(outcome="vaporized")),
        (EventType.CLEANUP_SCHEDULED, lambda d: d.update(target="s3")),
        (EventType.CLEANUP_FAILED, lambda d: d.pop("reason")),
        (EventType.CLEANUP_FAILED, lambda d: d.update(original={"data": "x" * 9000})),
    ],
)
def test_schema_rejects_what_the_models_reject(event_type: EventType, mutate: object) -> None:
    payload = dict(sample_payloads())[event_type]
    data = build_event(event_type, source="/x", data=payload).get_data()  # type: ignore[arg-type]
    assert isinstance(data, dict)
    mutate(data)  # type: ignore[operator]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, load_schema(event_type))


def test_schema_accepts_minimal_payload_from_a_foreign_producer() -> None:
    # Defaulted fields may be omitted by producers that do not use these models.
    run = RunFinished(run=make_run()).model_dump(mode="json", by_alias=True)["run"]
    minimal = {key: run[key] for key in ("engine", "apiVersion", "kind", "namespace", "name")}
    minimal |= {"uid": "u", "phase": "Failed"}
    jsonschema.validate({"run": minimal}, load_schema(EventType.RUN_FINISHED))
    assert RunFinished.model_validate({"run": minimal}).run.labels == {}
