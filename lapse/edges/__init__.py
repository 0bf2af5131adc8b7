"""The I/O edges: connections to NATS, Kubernetes and the database, and the adapters that
implement the handlers' ports on them."""
