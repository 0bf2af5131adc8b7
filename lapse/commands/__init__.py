"""One module per `lapse` sub-command; each exposes `register(subparsers)`."""
