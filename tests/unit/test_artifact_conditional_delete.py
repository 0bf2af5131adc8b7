"""The S3 conditional delete's answers, judged into the one failure hierarchy
(lapse/edges/artifacts/conditional.py). SeaweedFS (tests/integration/
test_artifact_reaper.py) answers 204 and 412 for real; the answers it never gives -
a 404 for a gone key (AWS S3's, SeaweedFS says 412), a 503 with Retry-After, a 403, a
dropped connection - come from httpx's MockTransport, a fake for exactly those."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from lapse.edges.artifacts.conditional import Deleted, delete_if_match
from lapse.functions.artifact_reaper.ports import StoredObject
from lapse.functions.reaping.failures import Refused, Unavailable

SECRET = "X-Amz-Signature=c0ffee"
OBJECTS = [StoredObject(f"k/{i}", 1, f'"e{i}"') for i in range(5)]


async def sign(path: str) -> str:
    return f"https://s3.test/bucket/{path}?{SECRET}"


async def run(answer: Callable[[httpx.Request], httpx.Response], there: bool = True) -> Deleted:
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers["If-Match"])
        return answer(request)

    async def exists(path: str) -> bool:
        return there

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        done = await delete_if_match(
            client, "art", OBJECTS, sign=sign, exists=exists,
            refused=lambda text: f"the object store refused: art: {text}", retry_after=1.0,
        )  # fmt: skip
    assert all(tag.startswith('"e') for tag in sent), "sent without the listed etag"
    return done


async def test_each_object_goes_with_its_etag_and_a_404_or_a_412_for_a_gone_key_is_gone() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        number = int(request.url.path.rsplit("/", 1)[1])
        return httpx.Response((204, 404, 412, 204, 412)[number])

    done = await run(answer, there=False)
    assert {o.path for o in done.deleted} == {"k/0", "k/3"}
    assert {o.path for o in done.gone} == {"k/1", "k/2", "k/4"}
    assert done.kept == [] and done.failure is None


async def test_a_412_for_a_key_still_there_is_kept() -> None:
    done = await run(lambda request: httpx.Response(412), there=True)
    assert len(done.kept) == len(OBJECTS)


@pytest.mark.parametrize(
    ("answer", "kind", "said"),
    [
        (httpx.Response(503, headers={"Retry-After": "7"}, text="<Code>SlowDown</Code>"),
         Unavailable, "HTTP 503 SlowDown"),
        (httpx.Response(403, text="<Error><Code>AccessDenied</Code></Error>"),
         Refused, "the object store refused: art: HTTP 403 AccessDenied"),
    ],
)  # fmt: skip
async def test_another_answer_stops_the_batch_as_the_failure_it_means(
    answer: httpx.Response, kind: type[Exception], said: str
) -> None:
    done = await run(lambda request: answer)
    failure = done.failure
    assert isinstance(failure, kind) and said in failure.reason
    assert SECRET not in failure.reason
    if isinstance(failure, Unavailable):
        assert failure.delay == 7.0


async def test_no_answer_is_an_outage_and_the_signed_url_is_not_quoted() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot reach {request.url}", request=request)

    done = await run(answer)
    failure = done.failure
    assert isinstance(failure, Unavailable)
    assert "no answer to a DELETE (ConnectError)" in failure.reason
    assert SECRET not in failure.reason and not done.deleted
