"""The footprint run's outputs in the embedded S3 server: planted as KFP's launcher writes
them under the pipeline root, and read back at the end with the demo's own client (not
lapse's), so the verdict rests on what the server holds."""

from __future__ import annotations

from dataclasses import dataclass, field

import obstore
from obstore.store import S3Store

from lapse.demo.scenario import (
    ARTIFACT_BUCKET,
    ARTIFACT_ROOT,
    PIPELINE_NAME,
    Sample,
    artifact_prefix,
)

# The tasks of the demo's pipeline and what each outputs (KFP: <task>/<output name>).
TASKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("prepare", ("dataset",)),
    ("train", ("model", "metrics")),
)


@dataclass(frozen=True)
class S3Access:
    """Where the embedded S3 server is, and the demo's own keys for it."""

    endpoint: str
    region: str
    access_key: str
    secret_key: str = field(repr=False)

    def client(self) -> S3Store:
        return S3Store(
            ARTIFACT_BUCKET,
            endpoint=self.endpoint,
            region=self.region,
            access_key_id=self.access_key,
            secret_access_key=self.secret_key,
            client_options={"allow_http": True},
        )


def output_keys(sample: Sample) -> list[str]:
    prefix = artifact_prefix(sample)
    return [f"{prefix}{task}/{output}" for task, outputs in TASKS for output in outputs]


def output_uris(sample: Sample) -> list[tuple[str, list[str]]]:
    """Per task, the s3:// URIs ML Metadata records for its outputs."""
    prefix = artifact_prefix(sample)
    return [
        (task, [f"s3://{ARTIFACT_BUCKET}/{prefix}{task}/{output}" for output in outputs])
        for task, outputs in TASKS
    ]


def beside_keys(sample: Sample) -> list[str]:
    """Objects next to the run's prefix that are not the run's: a sibling whose name starts
    with the run id, another run of the same pipeline, and the same path outside the
    pipeline root. All must survive."""
    run_id = sample.kfp_run_id
    return [
        f"{ARTIFACT_ROOT}{PIPELINE_NAME}/{run_id}-retry/train/model",
        f"{ARTIFACT_ROOT}{PIPELINE_NAME}/another-run/train/model",
        f"elsewhere/{PIPELINE_NAME}/{run_id}/train/model",
    ]


async def plant(s3: S3Access, keys: list[str]) -> None:
    store = s3.client()
    for key in keys:
        await obstore.put_async(store, key, f"demo output {key}\n".encode())


async def present(s3: S3Access, keys: list[str]) -> list[str]:
    """Which of `keys` the server holds."""
    store = s3.client()
    found: set[str] = set()
    async for page in obstore.list(store, None, chunk_size=1000):
        found |= {meta["path"] for meta in page}
    return [key for key in keys if key in found]
