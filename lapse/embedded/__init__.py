"""Local servers lapse can start for itself: NATS with JetStream, and a Kubernetes control
plane (etcd + kube-apiserver). `lapse up`/`lapse demo` use them when nothing is configured,
and the test suite uses the very same code, so what the tests prove is what users run."""
