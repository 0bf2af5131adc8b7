"""S3 conditional deletes: each object deleted with `If-Match: <the etag listed>`, so the
store itself keeps an object written again since lapse judged it (412 Precondition Failed).

obstore (0.12) sends no conditional delete, so each DELETE is a URL obstore presigns
(`sign_async`, in stores.py: SigV4 with the credentials obstore found, IRSA and instance
metadata included; lapse handles no key) sent by httpx with the `If-Match` header. A
presigned URL signs only `host`: S3 takes the other headers as sent, and AWS S3 (general
purpose buckets since 2025-09) and SeaweedFS honour `If-Match` on DeleteObject. The URL is
a bearer credential for one DELETE of one key for `URL_LIFETIME`: it is signed just
before it is sent, never logged, and no failure's reason quotes it.

Answers: 204 (or 200) deleted; 404 already gone; 412 changed, unless a HEAD finds nothing
there (SeaweedFS answers 412, not 404, for a key that is gone). Anything else is judged
into the one failure hierarchy (functions/reaping/failures.py): no answer, 408, 429 and
5xx are `Unavailable` (waited out), the rest `Refused`. The first failure stops the
batch; what was deleted before it stays deleted, and the next delivery lists what is left.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Final

import httpx

from lapse.functions.artifact_reaper.ports import Deletion, StoredObject
from lapse.functions.reaping.failures import Refused, TargetFailure, Unavailable, retry_delay
from lapse.functions.reaping.failures import transient as is_transient

# DELETEs in flight at once: a batch's workers, and the connections of the process's one
# client (stores.py), shared by the batches of every due event in flight. Per-object
# deletes are one round trip each; the bound keeps 1,000 keys from opening 1,000
# connections (docs/architecture.md, "The artifact-reaper": the measured rate).
CONCURRENCY: Final = 16
# How long a signed URL is good for: it is sent at once; this only bounds a leaked one.
URL_LIFETIME: Final = timedelta(minutes=5)
_CODE = re.compile(r"<Code>([A-Za-z]{1,64})</Code>")


@dataclass
class Deleted:
    """What `delete_if_match` did: `deleted`, `kept` (changed since listed), `gone`, and
    the failure that stopped it (the caller counts what was deleted, then raises it)."""

    deleted: list[StoredObject] = field(default_factory=list)
    kept: list[StoredObject] = field(default_factory=list)
    gone: list[StoredObject] = field(default_factory=list)
    failure: TargetFailure | None = None

    @property
    def deletion(self) -> Deletion:
        return Deletion(kept=tuple(self.kept), gone=tuple(self.gone))


async def delete_if_match(
    client: httpx.AsyncClient,
    store: str,
    objects: Sequence[StoredObject],
    *,
    sign: Callable[[str], Awaitable[str]],
    exists: Callable[[str], Awaitable[bool]],
    refused: Callable[[str], str],
    retry_after: float,
) -> Deleted:
    """Delete each object while it is the one listed (its etag), `CONCURRENCY` at a time.
    `sign`: a presigned DELETE URL for a key; `exists`: whether the key is there now (a
    HEAD), to tell a 412 for a changed object from one for a gone one (both raise
    `Unavailable` or `Refused`); `refused`: a refusal's reason, naming the store;
    `retry_after`: the first wait for a store that fails."""
    done = Deleted()
    pending = iter(objects)

    async def worker() -> None:
        for obj in _until_failed(pending, done):
            try:
                url = await sign(obj.path)
                response = await client.delete(url, headers={"If-Match": obj.etag or "*"})
                status = response.status_code
                if status in (200, 204):
                    done.deleted.append(obj)
                elif status == 404:
                    done.gone.append(obj)
                elif status == 412:
                    (done.kept if await exists(obj.path) else done.gone).append(obj)
                else:
                    done.failure = _failure(store, response, refused, retry_after)
            except httpx.TransportError as exc:  # its text may hold the URL: not quoted
                done.failure = Unavailable(
                    f"object store unavailable: {store}: no answer to a DELETE "
                    f"({type(exc).__name__})",
                    retry_after,
                )
            except (Unavailable, Refused) as exc:
                done.failure = exc

    await asyncio.gather(*(worker() for _ in range(min(CONCURRENCY, len(objects)))))
    return done


def _until_failed(pending: Iterator[StoredObject], done: Deleted) -> Iterator[StoredObject]:
    """The objects left to delete, until one delete failed (every worker stops)."""
    for obj in pending:
        if done.failure is not None:
            return
        yield obj


def _failure(
    store: str, response: httpx.Response, refused: Callable[[str], str], retry_after: float
) -> TargetFailure:
    status = response.status_code
    found = _CODE.search(response.text)
    said = f"HTTP {status}" + (f" {found.group(1)}" if found else "")
    if is_transient(status):
        wait = _retry_after(response)
        return Unavailable(
            f"object store unavailable: {store}: {said} to a DELETE",
            retry_delay(wait if wait is not None else retry_after),
        )
    return Refused(refused(f"{said} to a DELETE"))


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None
