"""Render a Knative module's config/ directories into one release YAML, the way `ko resolve`
would, with every ko:// reference replaced by the image build-images.sh made for it.

usage: render.py MODULE_DIR MODULE VERSION IMAGE_PREFIX SUBDIR... > release.yaml
A ko://MODULE/<path> reference becomes IMAGE_PREFIX/<path with / as ->:VERSION. Files are
taken in path order (as `kubectl apply -R` and `ko resolve -R` do); only *.yaml files.
Standard library only (start.sh runs it with the system python3)."""

import pathlib
import re
import sys


def main() -> int:
    root, module, version, prefix, *subdirs = sys.argv[1:]
    ref = re.compile(r"ko://" + re.escape(module) + r"/([A-Za-z0-9_./-]+)")

    def image(match: re.Match[str]) -> str:
        return f"{prefix}/{match.group(1).replace('/', '-')}:{version}"

    docs = []
    for sub in subdirs:
        for path in sorted(pathlib.Path(root, sub).rglob("*.yaml")):
            text = ref.sub(image, path.read_text())
            docs.append(f"# {path.relative_to(root)}\n{text.strip()}\n")
    sys.stdout.write("\n---\n".join(docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
