"""The `artifacts:` section of lapse.yaml: the object stores lapse may delete in, and what
each captures from a run when it is planned.

    artifacts:
      stores:
        - name: argo
          url: s3://argo-artifacts/       # the bucket and the prefix root: nothing outside
          endpoint: http://minio.argo:9000
          region: us-east-1
          min_prefix_depth: 2             # shallower prefixes are refused
          capture:                        # declared prefixes, per kind, below the root
            job: ["logs/{namespace}/{name}/{uid}/"]

No credentials here: the edge takes them where each cloud's users keep them (environment,
web identity / workload identity, instance metadata; docs/artifacts.md).
"""

from __future__ import annotations

import re
from typing import Annotated, Final

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from lapse.events.artifacts import Provider

SCHEMES: Final[dict[str, Provider]] = {"s3": "s3", "gs": "gcs", "az": "azure"}
# What a capture template may name: the run's own fields, a label, an annotation.
FIELDS: Final = frozenset({"namespace", "name", "uid", "kind", "run_id"})
_STORE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# `{field}` in a template; braces are not otherwise allowed.
PLACEHOLDER: Final = re.compile(r"\{([^{}]*)\}")


def _template(value: str) -> str:
    if not value.endswith("/") or value.startswith("/"):
        raise ValueError(f"{value!r}: a capture template is a prefix: no leading '/', ends in '/'")
    if "{" in PLACEHOLDER.sub("", value) or "}" in PLACEHOLDER.sub("", value):
        raise ValueError(f"{value!r}: unbalanced braces")
    for field in PLACEHOLDER.findall(value):
        kind, _, key = field.partition(":")
        if field not in FIELDS and not (kind in ("label", "annotation") and key):
            raise ValueError(
                f"{value!r}: {{{field}}} is not one of {', '.join(sorted(FIELDS))}, "
                "{label:<key>}, {annotation:<key>}"
            )
    return value


Template = Annotated[str, AfterValidator(_template)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ArtifactStore(_Model):
    """One bucket (Azure: container) and the prefix root lapse may delete under."""

    name: str
    url: str
    endpoint: str | None = Field(default=None, min_length=1)
    region: str | None = Field(default=None, min_length=1)
    # A prefix (or key) with fewer '/'-separated parts than this is refused: a template
    # whose values came out empty cannot take a whole tree.
    min_prefix_depth: int = Field(default=2, ge=1)
    # kind name (events/kinds.py) -> prefixes below `url` that hold a run's artifacts.
    capture: dict[str, tuple[Template, ...]] = Field(default_factory=dict)
    # Also what the run object records (Argo's output artifacts, main-logs among them),
    # when it is in this bucket and under this root.
    engine_outputs: bool = True

    @model_validator(mode="after")
    def _valid(self) -> ArtifactStore:
        if not _STORE_NAME.fullmatch(self.name):
            raise ValueError(f"{self.name!r} is not a store name (lower case, digits and -)")
        scheme, sep, rest = self.url.partition("://")
        if not sep or scheme not in SCHEMES:
            raise ValueError(f"url {self.url!r}: s3://bucket/prefix/, gs://... or az://...")
        bucket, _, root = rest.partition("/")
        if not bucket:
            raise ValueError(f"url {self.url!r} names no bucket")
        if root and (not root.endswith("/") or "//" in root or ".." in root.split("/")):
            raise ValueError(f"url {self.url!r}: the prefix root ends in '/', no empty parts")
        return self

    @property
    def provider(self) -> Provider:
        return SCHEMES[self.url.partition("://")[0]]

    @property
    def bucket(self) -> str:
        return self.url.partition("://")[2].partition("/")[0]

    @property
    def root(self) -> str:
        """The prefix root inside the bucket ('' for the whole bucket, else ends in '/')."""
        return self.url.partition("://")[2].partition("/")[2]


def _unique(stores: tuple[ArtifactStore, ...]) -> tuple[ArtifactStore, ...]:
    names = [store.name for store in stores]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"stores: the name {name!r} is used twice")
    return stores


class ArtifactsConfig(_Model):
    """No stores: the artifacts target is not planned and its reaper does not run."""

    stores: Annotated[tuple[ArtifactStore, ...], AfterValidator(_unique)] = ()

    def store(self, name: str) -> ArtifactStore | None:
        return next((store for store in self.stores if store.name == name), None)
