"""Build the krew archive of `kubectl loopback` and keep plugins/loopback.yaml in step.

    python plugins/build_krew.py [--out DIR] [--write-manifest]

The archive (kubectl-loopback-vVERSION.tar.gz) holds agent/kubectl_plugin.py, the package's
__init__.py (its version), agent/terminal.py (the sanitiser of what reaches the terminal,
standard library only), kubectl-loopback, a launcher that runs them with the user's
python3 (3.10 or newer; the plugin uses the standard library only), and LICENSE (the
project's Apache-2.0 text, which krew-index asks every plugin to ship). It is reproducible:
fixed owners, modes and times, so its sha256 is the manifest's whatever the machine. A
release uploads it to the manifest's uri; tests/test_kubectl_plugin.py rebuilds it and
checks the sha256 and that the unpacked launcher works, and `make dist` (tests/release/dist.py)
checks the archive it puts in dist/ against the manifest and for LICENSE.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import re
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "plugins" / "loopback.yaml"
LAUNCHER = b"""#!/bin/sh
# kubectl-loopback: `kubectl loopback` with the user's python3 (3.10 or newer), from the
# directory krew unpacked this archive into (krew links to this file from its bin/).
here=$(dirname "$(readlink -f "$0" 2>/dev/null || echo "$0")")
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m agent.kubectl_plugin "$@"
"""


def version() -> str:
    text = (REPO / "agent" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"$', text, re.M).group(1)  # type: ignore[union-attr]


def archive_bytes() -> bytes:
    files = [("kubectl-loopback", LAUNCHER, 0o755),
             ("agent/__init__.py", (REPO / "agent" / "__init__.py").read_bytes(), 0o644),
             ("agent/kubectl_plugin.py", (REPO / "agent" / "kubectl_plugin.py").read_bytes(),
              0o644),
             ("agent/terminal.py", (REPO / "agent" / "terminal.py").read_bytes(), 0o644),
             ("LICENSE", (REPO / "LICENSE").read_bytes(), 0o644)]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "build")
    p.add_argument("--write-manifest", action="store_true",
                   help="set the manifest's version, uri and sha256 to this build's")
    args = p.parse_args(argv)
    data = archive_bytes()
    v = version()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kubectl-loopback-v{v}.tar.gz"
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    print(f"{path} sha256 {digest}")
    if args.write_manifest:
        text = MANIFEST.read_text()
        text = re.sub(r"(?m)^(  version: )v\S+$", rf"\g<1>v{v}", text)
        text = re.sub(r"(?m)^(\s+sha256: )\S+$", rf"\g<1>{digest}", text)
        text = re.sub(r"/download/v[^/]+/kubectl-loopback-v[^/\s]+\.tar\.gz",
                      f"/download/v{v}/kubectl-loopback-v{v}.tar.gz", text)
        MANIFEST.write_text(text)
        print(f"{MANIFEST} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
