"""Writes KFP-shaped runs into ML Metadata with MLMD's own library (run in the test-only
venv that scripts/build-mlmd-venv.sh builds; it cannot import lapse: other protobuf).

Reads one JSON request on stdin and prints one JSON answer on stdout:
  {"mysql": {host, port, database, user, password},
   "runs": [{"run_id", "pipeline", "executions": [
       {"name", "state": "COMPLETE"|"RUNNING"|"CACHED"|...,
        "inputs": [artifact label], "outputs": [{"label", "uri"} or {"label"} to reuse]}]}]}
  -> {"artifacts": {label: id}, "executions": {name: id}, "contexts": {run_id: id}}
or, with "query": true, what MLMD's own API reads back (contexts by run, artifacts, events).

Each execution is recorded as KFP's driver and launcher do (backend/src/v2/metadata/
client.go): the pipeline context `system.Pipeline` (named by the pipeline), the run context
`system.PipelineRun` (named by the run id, child of the pipeline's), and PutExecution with
both contexts, its output artifacts (new, or an earlier run's reused by id as a cached task
does) as OUTPUT events and its inputs as INPUT events.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2 as pb


def connect(mysql: dict[str, Any]) -> metadata_store.MetadataStore:
    config = pb.ConnectionConfig()
    config.mysql.host = mysql["host"]
    config.mysql.port = int(mysql["port"])
    config.mysql.database = mysql["database"]
    config.mysql.user = mysql["user"]
    config.mysql.password = mysql["password"]
    return metadata_store.MetadataStore(config)


def context(store: metadata_store.MetadataStore, type_name: str, name: str) -> pb.Context:
    type_id = store.put_context_type(pb.ContextType(name=type_name))
    found = store.get_context_by_type_and_name(type_name, name)
    if found is not None:
        return found
    ctx = pb.Context(type_id=type_id, name=name)
    ctx.custom_properties["namespace"].string_value = "team-a"
    [ctx.id] = store.put_contexts([ctx])
    return ctx


def write(store: metadata_store.MetadataStore, request: dict[str, Any]) -> dict[str, Any]:
    artifact_type = store.put_artifact_type(pb.ArtifactType(name="system.Artifact"))
    execution_type = store.put_execution_type(pb.ExecutionType(name="system.ContainerExecution"))
    labels: dict[str, int] = {}
    executions: dict[str, int] = {}
    contexts: dict[str, int] = {}
    for run in request["runs"]:
        pipeline = context(store, "system.Pipeline", run["pipeline"])
        run_ctx = context(store, "system.PipelineRun", run["run_id"])
        contexts[run["run_id"]] = run_ctx.id
        if not store.get_parent_contexts_by_context(run_ctx.id):
            store.put_parent_contexts(
                [pb.ParentContext(child_id=run_ctx.id, parent_id=pipeline.id)]
            )
        for spec in run["executions"]:
            execution = pb.Execution(
                type_id=execution_type,
                name=f"{run['run_id']}/{spec['name']}",
                last_known_state=pb.Execution.State.Value(spec["state"]),
            )
            execution.custom_properties["task_name"].string_value = spec["name"]
            pairs = []
            for label in spec.get("inputs", []):
                event = pb.Event(type=pb.Event.INPUT, artifact_id=labels[label])
                pairs.append((None, event))
            for output in spec.get("outputs", []):
                event = pb.Event(type=pb.Event.OUTPUT)
                step = event.path.steps.add()
                step.key = output["label"]
                if "uri" in output:
                    artifact = pb.Artifact(type_id=artifact_type, uri=output["uri"])
                    artifact.custom_properties["display_name"].string_value = output["label"]
                    pairs.append((artifact, event))
                else:  # a cached task's output: the earlier run's artifact, by id
                    event.artifact_id = labels[output["label"]]
                    pairs.append((None, event))
            # An existing artifact goes by its id in the event alone, as KFP's Go client
            # sends it (PutExecutionRequest_ArtifactAndEvent with no Artifact).
            execution_id, artifact_ids, _ = store.put_execution(
                execution, pairs, [pipeline, run_ctx], reuse_context_if_already_exist=True
            )
            executions[spec["name"]] = execution_id
            for (artifact, event), artifact_id in zip(pairs, artifact_ids, strict=True):
                if artifact is not None:
                    labels[event.path.steps[0].key] = artifact_id
    return {"artifacts": labels, "executions": executions, "contexts": contexts}


def query(store: metadata_store.MetadataStore, request: dict[str, Any]) -> dict[str, Any]:
    """What MLMD's API says now: each run's context, executions and artifacts."""
    answer: dict[str, Any] = {"runs": {}, "artifacts": sorted(a.uri for a in store.get_artifacts())}
    for run_id in request["run_ids"]:
        ctx = store.get_context_by_type_and_name("system.PipelineRun", run_id)
        if ctx is None:
            answer["runs"][run_id] = None
            continue
        executions = store.get_executions_by_context(ctx.id)
        answer["runs"][run_id] = {
            "executions": len(executions),
            "artifacts": sorted(a.uri for a in store.get_artifacts_by_context(ctx.id)),
            "events": len(store.get_events_by_execution_ids([e.id for e in executions])),
        }
    pipelines = store.get_contexts_by_type("system.Pipeline")
    answer["pipelines"] = sorted(p.name for p in pipelines)
    return answer


def main() -> None:
    request = json.load(sys.stdin)
    store = connect(request["mysql"])
    json.dump(query(store, request) if request.get("query") else write(store, request), sys.stdout)


if __name__ == "__main__":
    main()
