"""The configured object stores, through obstore: S3 (and S3-compatible servers), GCS and
Azure behind one async API. An S3 store's objects are deleted one by one, each with
`If-Match: <the etag listed>` (conditional.py: obstore signs, httpx sends); a store with
`conditional_delete: false`, GCS and Azure, in batches (S3 DeleteObjects, 1,000 keys a
request; Azure's blob batch).

Why obstore: it is made for exactly this (async, one API for the three clouds, bulk
delete, listing in pages), it is a thin binding of the Rust `object_store` crate (no
boto3/botocore stack, no fsspec layer), and it finds credentials where each cloud's users
keep them: AWS_* variables, web identity tokens (EKS IRSA / pod identity), ECS and EC2
instance metadata; GOOGLE_* and workload identity on GKE; AZURE_* and managed identity.
lapse.yaml names stores, never credentials.

Failures are judged here, once, into the one failure hierarchy
(functions/reaping/failures.py): a refusal retrying will not change (403, 401, no such
bucket) is `Refused`; everything else (timeouts, refused connections, 5xx, 429) is
`Unavailable`, an outage the reaper waits out. obstore's own retries are kept short,
so an outage reaches the runtime's back-off (lapse/runtime/outages.py) and shows in
`lapse status`, instead of hiding inside one call for minutes.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

import httpx
import obstore
from obstore.exceptions import PermissionDeniedError, UnauthenticatedError
from obstore.store import AzureStore, GCSStore, S3Store

from lapse import telemetry
from lapse.config.schema import STORE_CONNECT_TIMEOUT, STORE_TIMEOUT
from lapse.edges.artifacts.conditional import CONCURRENCY, URL_LIFETIME, delete_if_match
from lapse.functions.artifact_reaper.ports import Deletion, StoredObject
from lapse.functions.artifact_reaper.stores import ArtifactsConfig, ArtifactStore
from lapse.functions.reaping.failures import Refused, Unavailable

if TYPE_CHECKING:
    from obstore import ObjectMeta
    from obstore.store import ClientConfig, ObjectStore, RetryConfig

# Short on purpose (see the module docstring): lapse.yaml's artifacts.timeout and
# artifacts.connect_timeout, these their defaults. One request gives up after `timeout`,
# and no retry of it begins once `timeout` has passed since its first try.
TIMEOUT: Final = STORE_TIMEOUT
CONNECT_TIMEOUT: Final = STORE_CONNECT_TIMEOUT
RETRIES: Final = 2
LIST_PAGE: Final = 1000
# The first wait for a store that does not answer; the runtime's back-off takes it from
# there (lapse/runtime/outages.py: doubling to 60 s).
RETRY_DELAY: Final = 1.0
# What a refusal says: the S3 error codes, and the HTTP statuses obstore reports in its
# generic errors (a listing's 403 is not a PermissionDeniedError).
_REFUSALS: Final = (
    "NoSuchBucket",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "401 Unauthorized",
    "403 Forbidden",
)


class ObstoreStores:
    """`lapse.functions.artifact_reaper.ports.ObjectStores` over the configured stores."""

    def __init__(
        self,
        config: ArtifactsConfig,
        *,
        timeout: timedelta = TIMEOUT,
        connect_timeout: timedelta = CONNECT_TIMEOUT,
    ) -> None:
        self._config = config
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._open: dict[str, ObjectStore] = {}
        self._http: httpx.AsyncClient | None = None

    def _store(self, name: str) -> ObjectStore:
        if name not in self._open:
            spec = self._config.store(name)
            if spec is None:
                raise Refused(_refused(name, "not configured (artifacts.stores)"))
            self._open[name] = open_store(
                spec, timeout=self._timeout, connect_timeout=self._connect_timeout
            )
        return self._open[name]

    async def list(self, store: str, prefix: str) -> list[StoredObject]:
        found: list[StoredObject] = []
        with _judged(store):
            stream = obstore.list(self._store(store), prefix, chunk_size=LIST_PAGE)
            try:
                async for page in stream:
                    found += [_stored(meta) for meta in page]
            except FileNotFoundError as exc:  # nothing under the prefix, unless the bucket is gone
                if "NoSuchBucket" in str(exc):
                    raise
        return found

    async def head(self, store: str, key: str) -> StoredObject | None:
        with _judged(store):
            try:
                meta = await obstore.head_async(self._store(store), key)
            except FileNotFoundError:
                return None
        return _stored(meta)

    async def current(
        self, store: str, objects: Sequence[StoredObject]
    ) -> tuple[StoredObject, ...]:
        """One listing under the objects' longest common '/'-separated prefix, in key order
        (S3 lists in UTF-8 binary order), up to the last of them: a batch is a run of
        consecutive keys of one listing, so this reads about as many as it checks."""
        if not objects:
            return ()
        paths = sorted(obj.path for obj in objects)
        wanted = set(paths)
        last = paths[-1]
        prefix = _common_folder(paths[0], last)
        found: list[StoredObject] = []
        with _judged(store):
            stream = obstore.list(self._store(store), prefix or None, chunk_size=LIST_PAGE)
            try:
                async for page in stream:
                    found += [_stored(meta) for meta in page if meta["path"] in wanted]
                    if page and page[-1]["path"] >= last:
                        break
            except FileNotFoundError as exc:
                if "NoSuchBucket" in str(exc):
                    raise
        return tuple(found)

    async def delete(self, store: str, objects: Sequence[StoredObject]) -> Deletion:
        spec = self._config.store(store)
        conditional = spec is not None and spec.conditional
        signed = [obj for obj in objects if conditional and obj.etag]
        batched = [obj for obj in objects if not (conditional and obj.etag)]
        deletion = Deletion()
        if signed:
            deletion = await self._delete_if_match(store, signed)
        if batched:
            with _judged(store):
                await obstore.delete_async(self._store(store), [obj.path for obj in batched])
            _count(store, batched)
        return deletion

    async def _delete_if_match(self, store: str, objects: Sequence[StoredObject]) -> Deletion:
        s3 = self._store(store)
        if not isinstance(s3, S3Store):  # `conditional` is S3's alone
            raise Refused(_refused(store, "a conditional delete is sent to S3 stores only"))

        async def sign(path: str) -> str:
            with _judged(store):
                return await obstore.sign_async(s3, "DELETE", path, URL_LIFETIME)

        async def exists(path: str) -> bool:
            return await self.head(store, path) is not None

        done = await delete_if_match(
            self._client(),
            store,
            objects,
            sign=sign,
            exists=exists,
            refused=lambda text: _refused(store, text),
            retry_after=RETRY_DELAY,
        )
        _count(store, done.deleted)
        if done.failure is not None:
            raise done.failure
        return done.deletion

    def _client(self) -> httpx.AsyncClient:
        """One client for every store's signed DELETEs, with the stores' timeouts."""
        if self._http is None:
            timeout = httpx.Timeout(
                self._timeout.total_seconds(), connect=self._connect_timeout.total_seconds()
            )
            limits = httpx.Limits(max_connections=CONCURRENCY)
            self._http = httpx.AsyncClient(timeout=timeout, limits=limits)
        return self._http


def _count(store: str, deleted: Sequence[StoredObject]) -> None:
    if deleted:
        telemetry.count_artifacts_deleted(store, len(deleted), sum(obj.size for obj in deleted))


def open_store(
    spec: ArtifactStore,
    *,
    timeout: timedelta = TIMEOUT,
    connect_timeout: timedelta = CONNECT_TIMEOUT,
) -> ObjectStore:
    """A client for one configured store, rooted at its bucket (keys are whole keys)."""
    client: ClientConfig = {"timeout": timeout, "connect_timeout": connect_timeout}
    if spec.endpoint and spec.endpoint.startswith("http://"):
        client["allow_http"] = True
    retry: RetryConfig = {"max_retries": RETRIES, "retry_timeout": timeout}
    options: dict[str, Any] = {"client_options": client, "retry_config": retry}
    if spec.provider == "s3":
        s3: dict[str, str] = {}
        if spec.endpoint:
            s3["endpoint"] = spec.endpoint
        if spec.region:
            s3["region"] = spec.region
        return S3Store(spec.bucket, config=s3, **options)  # type: ignore[arg-type]
    if spec.provider == "gcs":
        return GCSStore(spec.bucket, **options)
    azure = {"endpoint": spec.endpoint} if spec.endpoint else {}
    return AzureStore(spec.bucket, config=azure, **options)  # type: ignore[arg-type]


class _judged:
    """obstore's errors as the port's: refused, or unavailable (an outage)."""

    def __init__(self, store: str) -> None:
        self._store = store

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        if exc is None or not isinstance(exc, Exception):
            return
        if isinstance(exc, Refused | Unavailable):
            return
        full = " ".join(str(exc).split())
        text = full[:300]
        if isinstance(exc, FileNotFoundError) and "NoSuchBucket" not in full:
            return  # the caller's to read: nothing there
        if isinstance(exc, PermissionDeniedError | UnauthenticatedError) or any(
            word in full for word in _REFUSALS
        ):
            raise Refused(_refused(self._store, text)) from exc
        raise Unavailable(f"object store unavailable: {self._store}: {text}", RETRY_DELAY) from exc


def _refused(store: str, text: str) -> str:
    """A refusal's reason names the store: misconfigured credentials must be loud."""
    return f"the object store refused: {store}: {text}; nothing more was deleted"


def _common_folder(first: str, last: str) -> str:
    """The longest run of whole '/'-separated parts both keys start with, ending in '/'."""
    common: list[str] = []
    for a, b in zip(first.split("/")[:-1], last.split("/")[:-1], strict=False):
        if a != b:
            break
        common.append(a + "/")
    return "".join(common)


def _stored(meta: ObjectMeta) -> StoredObject:
    return StoredObject(meta["path"], meta["size"], meta.get("e_tag"))
