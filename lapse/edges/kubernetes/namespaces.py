"""Namespaces, and listing a kind where the scope is namespaces: one namespace at a time,
page by page, so neither the request nor the memory follows the whole cluster.

The API server answers a list of every namespace of a custom resource by walking the
whole kind in etcd (or the watch cache); a namespaced list reads one key range. Where the
scope is one namespace or a glob of them (`lapse reconcile --namespace`, `lapse plan
--namespace-glob`), listing the matching namespaces one after another costs one request a
page of each instead of a page-walk of the whole kind filtered here, and what a caller
counts per namespace (keep_last's groups live in one) is held one namespace at a time.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from kubernetes import client

from lapse.edges.kubernetes.client import request, server_attributes
from lapse.edges.kubernetes.objects import KubeObjects, Page, finished_pages
from lapse.events.kinds import KindSpec

PAGE_SIZE: Final = 500
_GLOB_CHARS = re.compile(r"[*?\[]")


async def namespace_names(
    api_client: client.ApiClient, executor: ThreadPoolExecutor, *, page_size: int = PAGE_SIZE
) -> list[str]:
    """Every namespace's name, listed a page at a time (names only are kept)."""
    core = client.CoreV1Api(api_client)
    names: list[str] = []
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"limit": page_size}
        if token:
            kwargs["_continue"] = token
        call = functools.partial(core.list_namespace_with_http_info, **kwargs)
        page = await request(
            executor, server_attributes(api_client), "GET", "/api/v1/namespaces", None, call
        )
        names += [item.metadata.name for item in page.items]
        token = page.metadata._continue
        if not token:
            return names


def is_glob(pattern: str) -> bool:
    return bool(_GLOB_CHARS.search(pattern))


async def finished_pages_within(
    objects: KubeObjects,
    kind: KindSpec,
    scope: str | None,
    *,
    page_size: int = PAGE_SIZE,
    label_selector: str | None = None,
) -> AsyncIterator[tuple[str | None, Page]]:
    """`finished_pages` of `kind` where `scope` says: every namespace at once (None), one
    namespace (a name), or each namespace whose name matches a glob in turn, each yielded
    page with the namespace it lists (None for the cluster-wide list). Every request
    carries `limit`; a namespace that goes away between the two lists has nothing left."""
    if scope is None or not is_glob(scope):
        async for page in finished_pages(
            objects, kind, scope, page_size=page_size, label_selector=label_selector
        ):
            yield scope, page
        return
    names = await namespace_names(objects.api_client, objects.executor, page_size=page_size)
    for namespace in names:
        if not fnmatch.fnmatchcase(namespace, scope):
            continue
        async for page in finished_pages(
            objects, kind, namespace, page_size=page_size, label_selector=label_selector
        ):
            yield namespace, page
