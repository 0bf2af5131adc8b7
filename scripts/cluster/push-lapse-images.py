"""Put lapse's images (`make images`) in the cluster's registry, where containerd pulls from.

Builds them first if the cache does not hold this tree's build (scripts/build-images.py is
cached by its inputs, so a second run builds nothing), then copies each docker-archive to
127.0.0.1:5000/lapse/<name>:<version>-<hash of the inputs> with skopeo (plain http). The
tag names the build: containerd keeps pulled images across cluster stops, and a tag reused
for other content would run the old image. Prints a JSON object: the dev overlay's image
name (dev.local/lapse/<name>) -> the pushed reference, ready for a kustomize `images:` list.

Usage: python scripts/cluster/push-lapse-images.py   (the running cluster's registry)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = os.environ.get("LAPSE_CLUSTER_REGISTRY", "127.0.0.1:5000")


def main() -> int:
    built = subprocess.run(
        ["nice", "-n", "19", sys.executable, str(ROOT / "scripts/build-images.py")],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        sys.stderr.write(built.stderr)
        return built.returncode
    summary = json.loads(built.stdout)
    tag = Path(summary["directory"]).name  # <version>-<hash of the inputs>
    pushed: dict[str, str] = {}
    for name, image in sorted(summary["images"].items()):
        target = f"{REGISTRY}/lapse/{name}:{tag}"
        copy = subprocess.run(
            [
                "skopeo", "copy", "--quiet", "--dest-tls-verify=false",
                f"docker-archive:{image['archive']}", f"docker://{target}",
            ],
            capture_output=True,
            text=True,
        )  # fmt: skip
        if copy.returncode != 0:
            sys.stderr.write(f"skopeo copy {name} -> {target}: {copy.stderr}")
            return copy.returncode
        pushed[image["reference"].rsplit(":", 1)[0]] = target
    print(json.dumps(pushed, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
