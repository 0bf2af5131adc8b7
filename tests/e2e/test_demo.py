"""`lapse demo` as a newcomer runs it: a subprocess on its own embedded servers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.schema import CreateIndex, CreateTable, MetaData

# The one test module that imports the demo (pyproject's import contract on tests/): the
# demo keeps its own copy of KFP's tables, held here to the tests' account of KFP.
from lapse.demo import kfp as demo_kfp
from lapse.demo.scenario import Kind, make_samples, run_object
from tests import kfp_schema
from tests.unit.test_engine_fixtures import check_job_shape

pytestmark = [pytest.mark.kube, pytest.mark.nats]

# Far above what a loopback scheduler needs (tens of milliseconds), far below a TTL.
LATENESS_BOUND = 2.0


def test_demo_deletes_what_it_should_and_keeps_what_it_should(tmp_path: Path) -> None:
    # The demo's temporary directory lands here, so the test can see it is cleaned up.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "lapse.cli", "demo", "--count", "8", "--no-live", "-o", "json"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout)

    assert summary["ok"] is True
    assert summary["problems"] == []
    # Eight runs are one of each way to expire: four plain Workflows (two with Argo's
    # ttlStrategy), two KFP runs with rows, one kept, a Tekton PipelineRun and a Job; and
    # the ninth is the KFP run whose whole footprint goes (kfp-footprint).
    assert summary["workflows"] == 9
    assert summary["kinds"] == {
        "Workflow": {"runs": 7, "deleted": 6},
        "PipelineRun": {"runs": 1, "deleted": 1},
        "Job": {"runs": 1, "deleted": 1},
    }
    assert summary["objects"] == {"expected": 8, "deleted": 8}
    assert summary["rowSets"] == {"expected": 3, "deleted": 3, "rows": 21}
    assert summary["kept"] == {"expected": 1, "present": 1}
    assert summary["failed"] == 0

    lateness = summary["latenessSeconds"]
    assert lateness["count"] == 8 + 3 + 1
    assert lateness["byTarget"]["kubernetes"]["count"] == 8
    assert lateness["byTarget"]["database"]["count"] == 3
    assert lateness["byTarget"]["artifacts"]["count"] == 1
    assert isinstance(lateness["p99"], float)
    assert 0 <= lateness["p50"] <= lateness["p99"] < LATENESS_BOUND

    # One KFP run's footprint, each part at its own deadline, and the final check read
    # the database and the S3 server: the run's metadata rows and artifacts are gone, the
    # pipeline's context (every run's) and the objects planted beside its prefix are not.
    footprint = summary["footprint"]
    assert footprint["run"] == "kfp-footprint"
    parts = [footprint[part] for part in ("object", "rows", "artifacts")]
    assert [p["state"] for p in parts] == ["deleted"] * 3
    assert [p["dueSeconds"] for p in parts] == [4, 10, 16]
    for part in parts:
        assert 0 <= part["latenessSeconds"] < LATENESS_BOUND
    assert footprint["metadata"] == {"rows": 29, "left": 0, "pipelineContextKept": True}
    assert footprint["s3"] == {"objects": 3, "left": 0, "beside": 3, "besideLeft": 3}
    assert footprint["note"] is None
    for target in ("object", "rows", "artifacts"):
        assert re.search(rf"deleted +{target} +kfp-footprint ", result.stderr), result.stderr

    assert summary["seconds"]["tour"] < 60
    assert not list(tmp_path.iterdir()), "the demo leaves nothing behind without --keep"
    # Progress went to stderr, one line per step, so stdout stayed pure JSON.
    assert re.search(r"deleted +rows +kfp-01 ", result.stderr), result.stderr
    assert re.search(r"kept +object +keep-06 ", result.stderr), result.stderr


def ddl(metadata: MetaData, table: str, dialect: Dialect) -> list[str]:
    """The CREATE TABLE and CREATE INDEX statements of `table` as `dialect` runs them."""
    source = metadata.tables[table]
    statements = [str(CreateTable(source).compile(dialect=dialect))]
    statements += sorted(
        str(CreateIndex(index).compile(dialect=dialect)) for index in source.indexes
    )
    return statements


def test_the_demo_makes_kfp_tables_as_the_tests_know_kfp() -> None:
    # The demo's SQLite file is what a newcomer sees of KFP: the same tables, keys and
    # per-database types as the tests' account (tests/kfp_schema.py), on every dialect.
    assert demo_kfp.KFP_TABLES == kfp_schema.KFP_TABLES
    assert set(demo_kfp.metadata.tables) == set(kfp_schema.KFP_TABLES)
    for name in ("sqlite", "postgresql", "mysql"):
        dialect = make_url(f"{name}://").get_dialect()()
        for table in demo_kfp.KFP_TABLES:
            assert ddl(demo_kfp.metadata, table, dialect) == ddl(
                kfp_schema.metadata, table, dialect
            ), f"{table} on {dialect.name}"


def test_the_demos_job_is_shaped_as_the_job_controller_writes_it() -> None:
    """The demo's own Job (it writes the status itself) against the Jobs the real controller
    wrote on the test cluster (tests/fixtures/engines/, tests/unit/test_engine_fixtures.py)."""
    jobs = [s for s in make_samples(40) if s.kind is Kind.JOB]
    assert jobs
    for sample in jobs:
        body, status = run_object(sample, datetime(2030, 1, 1, tzinfo=UTC))
        check_job_shape("lapse.demo.scenario.run_object", body["metadata"], status)
