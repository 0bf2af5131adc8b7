"""What runs the handlers: the registry, the dispatcher and routing, the ingress, the watcher,
the whole pipeline (`lapse up`) and the Knative function shell."""
