"""The lapse event contract: what flows between the functions.

- `events.types`: CloudEvent types and cleanup outcomes
- `events.run`, `events.models`: the payloads (camelCase JSON), one model per type
- `events.builder`: `build_event` / `parse_payload`, the only way events are made and read
- `events.schemas`: JSON Schemas generated from the models
- `events.nats_binding`: CloudEvents <-> NATS messages
- `events.subjects`: their subjects
- `events.adapters`: engine objects and foreign events -> RunFinished / RunDeleted

Nothing here does network I/O.
"""

from events.builder import build_event, parse_payload
from events.errors import BindingError, InvalidEvent
from events.types import EventType, Outcome

__all__ = ["BindingError", "EventType", "InvalidEvent", "Outcome", "build_event", "parse_payload"]
