"""Print a PATH that holds only the commands of declared Debian packages.

``make test`` runs the suite under it, so a test (or a tool a test drives, such as
virtme-ng) that needs a command from a package the Makefile does not install fails
here, on every machine, instead of only on a fresh one. The PATH is:

- the venv's bin (pip packages: pytest, vng, kubectl, ...), then
- a directory of symlinks to every command of: the packages named on the command line
  (the Makefile's), their installed dependencies (Depends, Pre-Depends; apt installs
  those), and what a minimal Debian has before anything is installed (Essential: yes
  and Priority: required, as debootstrap's minbase and the debian image have).

Usage: declared_path.py BIN_DIR VENV_BIN PACKAGE...   (prints the PATH)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

COMMAND_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
_DEP_NAME = re.compile(r"^\s*([a-z0-9][a-z0-9+.-]*)")


def installed() -> dict[str, dict[str, str]]:
    """Installed packages: name -> {essential, priority, depends, provides}."""
    fmt = "${Package}\t${Essential}\t${Priority}\t${Pre-Depends}, ${Depends}\t${Provides}" \
          "\t${db:Status-Status}\n"
    out = subprocess.run(["dpkg-query", "-W", "-f", fmt], capture_output=True, text=True,
                         check=True).stdout
    pkgs: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        name, essential, priority, depends, provides, status = line.split("\t")
        if status == "installed":
            pkgs[name] = {"essential": essential, "priority": priority, "depends": depends,
                          "provides": provides}
    return pkgs


def _names(field: str) -> list[list[str]]:
    """'a (>= 1) | b, c:any' -> [['a', 'b'], ['c']]."""
    groups = []
    for group in field.split(","):
        alts = [m.group(1) for alt in group.split("|") if (m := _DEP_NAME.match(alt))]
        if alts:
            groups.append(alts)
    return groups


def closure(roots: list[str], pkgs: dict[str, dict[str, str]]) -> set[str]:
    providers: dict[str, list[str]] = {}
    for name, info in pkgs.items():
        for alts in _names(info["provides"]):
            providers.setdefault(alts[0], []).append(name)
    missing = [r for r in roots if r not in pkgs]
    if missing:
        sys.exit(f"declared_path: declared packages not installed: {' '.join(missing)} "
                 "(run make deps)")
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for alts in _names(pkgs[name]["depends"]):
            # apt installed one alternative (or a provider of a virtual package): take all
            # installed ones, as either could be the one that satisfied it
            for alt in alts:
                todo += [alt] if alt in pkgs else providers.get(alt, [])
    return seen


def owned_files(packages: set[str]) -> set[str]:
    info = Path("/var/lib/dpkg/info")
    files: set[str] = set()
    for name in packages:
        for lst in (info / f"{name}.list", *info.glob(f"{name}:*.list")):
            if lst.is_file():
                for line in lst.read_text(errors="replace").splitlines():
                    if line.startswith(tuple(d + "/" for d in COMMAND_DIRS)):
                        files.add(os.path.realpath(line))
    return files


def build(bin_dir: Path, packages: list[str]) -> int:
    pkgs = installed()
    base = [n for n, i in pkgs.items() if i["essential"] == "yes" or i["priority"] == "required"]
    owned = owned_files(closure([*packages, *base], pkgs))
    shutil.rmtree(bin_dir, ignore_errors=True)
    bin_dir.mkdir(parents=True)
    count = 0
    for d in COMMAND_DIRS:
        if not os.path.isdir(d):
            continue
        for entry in sorted(os.listdir(d)):
            path = os.path.join(d, entry)
            link = bin_dir / entry
            # by the real file, so alternatives (iptables -> xtables-legacy-multi) count
            if os.path.realpath(path) in owned and not link.exists() and os.access(path, os.X_OK):
                link.symlink_to(path)
                count += 1
    return count


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    bin_dir, venv_bin, packages = Path(argv[0]).resolve(), Path(argv[1]).resolve(), argv[2:]
    build(bin_dir, packages)
    print(f"{venv_bin}:{bin_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
