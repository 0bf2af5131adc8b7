"""The one configuration loader: `lapse.yaml` plus environment overrides, checked at start-up.

Where the file comes from: the `path` argument (the CLI's `--config`), else the environment
variable `LAPSE_CONFIG`, else there is no file and every setting has its default.
`lapse.example.yaml` at the repository root documents every key.

Environment overrides win over the file. Their names are `LAPSE_` followed by the key path
in upper case with `__` between the levels:

    LAPSE_NATS__URL=nats://nats:4222           nats.url
    LAPSE_SAFETY__DRY_RUN=true                 safety.dry_run
    LAPSE_SAFETY__MASS_DELETION_BRAKE__WINDOW=2m
    LAPSE_SAFETY__NAMESPACES__EXCLUDE=kube-*,argo   a list: comma-separated
    LAPSE_DATABASE__URL=                       empty: unset an optional key (here: SQLite)

Values are text, validated exactly like the file's (booleans true/false/yes/no/1/0,
durations like `30s`). Lists of objects (`policies`, `database.targets.tables`) can only be
set in the file. `LAPSE_*` names without `__` (such as `LAPSE_CONFIG`) are not overrides;
an override naming an unknown key is an error, as is an unknown key in the file.

Every problem is reported as a `ConfigError` whose text is one line naming where it is, e.g.
`lapse.yaml: policies[2].kubernetes.ttl: '3x' is not a duration (unknown unit 'x'; ...)` or
`LAPSE_SAFETY__DRY_RUN: 'maybe' is not a boolean (use true or false)`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lapse.config.database_syntax import DatabaseURLError
    from lapse.config.database_url import async_url
    from lapse.config.errors import ConfigError
    from lapse.config.loader import CONFIG_ENV, ENV_PREFIX, ENV_SEPARATOR, load_config
    from lapse.config.schema import (
        ArgoArchiveTarget,
        ChildTable,
        DatabaseConfig,
        DatabaseTargets,
        IngressConfig,
        KfpTarget,
        KubernetesConfig,
        LapseConfig,
        NatsConfig,
        ReconcileConfig,
        Streams,
        TableTarget,
    )

# Imported on first use (PEP 562): `lapse.config.redact`, which every command's logging
# uses, must not bring pydantic and SQLAlchemy into `lapse --help` (docs/cli.md, "Start-up").
_WHERE = {
    "DatabaseURLError": "database_syntax",
    "async_url": "database_url",
    "ConfigError": "errors",
    "CONFIG_ENV": "loader",
    "ENV_PREFIX": "loader",
    "ENV_SEPARATOR": "loader",
    "load_config": "loader",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name, "schema" if name in __all__ else None)
    if module is None:
        raise AttributeError(f"module 'lapse.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lapse.config.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "ENV_SEPARATOR",
    "ArgoArchiveTarget",
    "ChildTable",
    "ConfigError",
    "DatabaseConfig",
    "DatabaseTargets",
    "DatabaseURLError",
    "IngressConfig",
    "KfpTarget",
    "KubernetesConfig",
    "LapseConfig",
    "NatsConfig",
    "ReconcileConfig",
    "Streams",
    "TableTarget",
    "async_url",
    "load_config",
]
