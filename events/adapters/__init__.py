"""Engine adapters: what Argo, Tekton, Kubernetes and Knative emit -> RunFinished/RunDeleted.

Pure functions: every input gives a result (`RunFinished`, `RunDeleted`, `Ignored`,
`NeedsFetch`) or raises `InvalidEvent` with a reason; the GET a `NeedsFetch` asks for is
done by the caller.
"""

from lapse.events.adapters.argo import adapt_workflow
from lapse.events.adapters.dispatch import adapt_cloudevent, adapt_object
from lapse.events.adapters.job import adapt_job
from lapse.events.adapters.kube_events import adapt_kubernetes_event
from lapse.events.adapters.result import AdapterResult, Ignored, NeedsFetch
from lapse.events.adapters.tekton import adapt_pipelinerun, adapt_tekton_event

__all__ = [
    "AdapterResult",
    "Ignored",
    "NeedsFetch",
    "adapt_cloudevent",
    "adapt_job",
    "adapt_kubernetes_event",
    "adapt_object",
    "adapt_pipelinerun",
    "adapt_tekton_event",
    "adapt_workflow",
]
