"""Extract a tar archive without trusting it, the same way on every supported Python.

``TarFile.extractall(filter="data")`` would do this, but ``filter=`` arrived in 3.11.4
(Debian 12's python3 is 3.11.2), and without it a member named ``../x`` or an absolute
path, a link pointing out of the target, or a device node is extracted as given.
"""

from __future__ import annotations

import tarfile
from pathlib import Path, PurePosixPath


class UnsafeMember(ValueError):
    """A member that would land outside the target or is not a plain file or directory."""


def extract(tar: tarfile.TarFile, dest: Path) -> list[Path]:
    """Regular files and directories only, each inside ``dest``; file modes kept to
    rwx for the owner and r-x for the rest (no setuid, no world write). Refuses the whole
    archive, before writing anything, if one member is unsafe. Returns what it wrote."""
    dest = dest.resolve()
    plan: list[tuple[tarfile.TarInfo, Path]] = []
    for member in tar.getmembers():
        name = PurePosixPath(member.name)
        if name.is_absolute() or ".." in name.parts:
            raise UnsafeMember(f"{member.name!r}: a path outside the archive's directory")
        if not (member.isreg() or member.isdir()):
            raise UnsafeMember(f"{member.name!r}: not a regular file or directory")
        target = dest.joinpath(*name.parts).resolve()
        if target != dest and dest not in target.parents:
            raise UnsafeMember(f"{member.name!r}: resolves outside {dest}")
        plan.append((member, target))
    written: list[Path] = []
    for member, target in plan:
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        src = tar.extractfile(member)
        assert src is not None  # a regular member always has data
        with src, open(target, "wb") as out:
            while chunk := src.read(1 << 16):
                out.write(chunk)
        target.chmod(member.mode & 0o755 | 0o600)
        written.append(target)
    return written
