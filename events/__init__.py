"""The lapse event contract: what flows between the functions.

- `lapse.events.types`: CloudEvent types and cleanup outcomes
- `lapse.events.run`, `lapse.events.models`: the payloads (camelCase JSON), one model per type
- `lapse.events.builder`: `build_event` / `parse_payload`, the only way events are made and read
- `lapse.events.schemas`: JSON Schemas generated from the models
- `lapse.events.nats_binding`: CloudEvents <-> NATS messages
- `lapse.events.subjects`: their subjects
- `lapse.events.adapters`: engine objects and foreign events -> RunFinished / RunDeleted

Nothing here does network I/O.
"""

from lapse.events.builder import build_event, parse_payload
from lapse.events.errors import BindingError, InvalidEvent
from lapse.events.types import EventType, Outcome

__all__ = ["BindingError", "EventType", "InvalidEvent", "Outcome", "build_event", "parse_payload"]
