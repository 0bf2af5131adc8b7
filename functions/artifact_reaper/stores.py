"""The `artifacts:` section of lapse.yaml: the object stores lapse may delete in, and what
each captures from a run when it is planned.

    artifacts:
      stores:
        - name: argo
          url: s3://argo-artifacts/       # the bucket and the prefix root: nothing outside
          endpoint: http://minio.argo:9000
          region: us-east-1
          min_prefix_depth: 2             # shallower prefixes are refused
          namespaces: ["team-*"]          # whose runs it serves (shell globs; default: any)
          kinds: [argo-workflow]          # which kinds' runs (default: any)
          roots: ["{namespace}/"]         # where one run may delete, below the url (default)
          capture:                        # declared prefixes, per kind, below the root
            job: ["logs/{namespace}/{name}/{uid}/"]

Ownership is proved from what a tenant cannot write (docs/security.md, "Tenants and object
stores"): a run's status (Argo's output artifacts), labels and annotations are its
tenant's to write, so the keys they name are deleted only inside the run's own *roots*,
rendered from the run's namespace, name, uid and kind (the API server's identity of the
object), never from a label. A declared capture rendered from those fields alone is the
run's own too; one naming a label or annotation (deprecated), or `{run_id}` (a label), is
bounded by the roots like a recorded key.

No credentials here: the edge takes them where each cloud's users keep them (environment,
web identity / workload identity, instance metadata; docs/artifacts.md).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Annotated, Final

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from lapse.events.artifacts import Provider

SCHEMES: Final[dict[str, Provider]] = {"s3": "s3", "gs": "gcs", "az": "azure"}
# What a capture template may name: the run's own fields, a label, an annotation.
FIELDS: Final = frozenset({"namespace", "name", "uid", "kind", "run_id"})
# What a root (and a declared capture that is its own proof) may name: the object's
# identity as the API server keeps it. `run_id` is KFP's label, the tenant's to write.
IDENTITY: Final = frozenset({"namespace", "name", "uid", "kind"})
# A root naming one of these names one run: the run may delete the root itself.
ONE_RUN: Final = frozenset({"name", "uid"})
# A root naming one of these keeps namespaces apart (a uid is unique in the cluster).
SEPARATES: Final = frozenset({"namespace", "uid"})
DEFAULT_ROOTS: Final = ("{namespace}/",)
_STORE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# `{field}` in a template; braces are not otherwise allowed.
PLACEHOLDER: Final = re.compile(r"\{([^{}]*)\}")
_GLOB = re.compile(r"[*?\[]")


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


def _root(value: str) -> str:
    """A root: '' (the store's whole url root) or a prefix naming only identity fields."""
    if value == "":
        return value
    _template(value)
    parts = value.split("/")[:-1]
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{value!r}: a root has no empty, '.' or '..' parts")
    for field in PLACEHOLDER.findall(value):
        if field not in IDENTITY:
            raise ValueError(
                f"{value!r}: a root is rendered from the run's identity only "
                f"({', '.join(sorted(IDENTITY))}); {{{field}}} is the tenant's to write"
            )
    return value


Root = Annotated[str, AfterValidator(_root)]


def fields(template: str) -> frozenset[str]:
    return frozenset(PLACEHOLDER.findall(template))


def is_identity(template: str) -> bool:
    """Rendered from the API server's identity of the run alone (no label, no run_id)."""
    return fields(template) <= IDENTITY


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
    # Whose runs this store serves: namespaces (shell globs) and kind names. A run of
    # another has nothing deleted here.
    namespaces: tuple[str, ...] = ("*",)
    kinds: tuple[str, ...] | None = None
    # Where one run may delete, below `url`, rendered from its identity: a key its status
    # names (and a label-rendered capture) outside all of them is kept. '': the whole
    # store (a store of one namespace's only; a start-up warning otherwise).
    roots: tuple[Root, ...] = Field(default=DEFAULT_ROOTS, min_length=1)
    # Each object deleted with `If-Match: <the etag listed>`, so the store itself keeps
    # one rewritten since (docs/architecture.md, "The artifact-reaper"). None: yes for
    # S3 (AWS S3 and SeaweedFS honour it); false for an S3-compatible server that rejects
    # or ignores the header (MinIO ignores it), and for GCS and Azure, where lapse sends
    # none yet: batched deletes. Every store's batch is listed again just before its
    # delete, and deleted only as it was judged.
    conditional_delete: bool | None = None

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
        if self.conditional_delete and self.provider != "s3":
            raise ValueError(
                f"store {self.name!r}: conditional_delete is sent to S3 stores only "
                "(GCS and Azure: the batch is listed again before its delete)"
            )
        return self

    def serves(self, namespace: str, kind: str | None) -> str | None:
        """None when this store serves the run's namespace and kind, else why not."""
        if not any(fnmatch.fnmatchcase(namespace, glob) for glob in self.namespaces):
            return f"store {self.name!r} does not serve namespace {namespace!r}"
        if self.kinds is not None and kind not in self.kinds:
            return f"store {self.name!r} does not serve kind {kind or 'unknown'!r}"
        return None

    def warnings(self) -> list[str]:
        """What start-up says of this store: roots that do not keep tenants apart, and
        deprecated templates."""
        found: list[str] = []
        one_namespace = len(self.namespaces) == 1 and not _GLOB.search(self.namespaces[0])
        for root in self.roots:
            if not one_namespace and not fields(root) & SEPARATES:
                found.append(
                    f"artifacts store {self.name!r}: root {root or repr('')} bounds no "
                    "namespace and the store serves more than one: a run may delete what "
                    "another namespace's runs wrote there (name {namespace} or {uid} in "
                    "roots, or list one namespace in namespaces)"
                )
        for kind, templates in self.capture.items():
            for template in templates:
                if any(field.partition(":")[1] for field in fields(template)):
                    found.append(
                        f"artifacts store {self.name!r}: capture {kind}: {template!r} names "
                        "a label or annotation (deprecated: the tenant writes it); it is "
                        "deleted only inside the run's roots"
                    )
                elif not one_namespace and not fields(template) & SEPARATES:
                    found.append(
                        f"artifacts store {self.name!r}: capture {kind}: {template!r} "
                        "names neither {namespace} nor {uid}: runs of two namespaces with "
                        "one name share it"
                    )
        return found

    @property
    def provider(self) -> Provider:
        return SCHEMES[self.url.partition("://")[0]]

    @property
    def conditional(self) -> bool:
        """Whether each object is deleted with `If-Match` (`conditional_delete`)."""
        return self.provider == "s3" and self.conditional_delete is not False

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

    def warnings(self) -> list[str]:
        return [warning for store in self.stores for warning in store.warnings()]
