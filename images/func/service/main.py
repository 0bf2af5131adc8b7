"""Glue between the function and func-python (as func's host builder writes it)."""

import logging

from func_python.cloudevent import serve

logging.basicConfig(level=logging.INFO)

try:
    from function import new as handler  # type: ignore[import]
except ImportError:
    from function import handle as handler  # type: ignore[import]

if __name__ == "__main__":
    logging.info("Functions middleware invoking user function")
    serve(handler)
