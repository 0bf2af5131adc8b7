"""One module per function: how its handler is built from the resources (`build`).

Apart so that a function's process imports only its own edges: lapse/runtime/registry.py
imports the one module a process runs, and each function image carries only what that
module needs (pyproject.toml, `[tool.lapse.functions]`; images/README.md).
"""
