"""`python -m lapse.events.schemas [--check]`: rewrite the payload schemas, or verify them."""

from __future__ import annotations

import argparse
import sys

from lapse.events.schemas import SCHEMA_DIR, stale_schemas, write_schemas


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lapse.events.schemas", description=__doc__)
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a file is missing, stale or unknown",
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_schemas()
        for name in stale:
            print(f"stale: {SCHEMA_DIR / name}", file=sys.stderr)
        return 1 if stale else 0
    for path in write_schemas():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
