"""The suite's PATH holds only declared packages' commands (tests/declared_path.py), and the
VM's tool check names what virtme-ng needs."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import declared_path

from lab import vm

pytestmark = pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not Debian")


def test_only_declared_packages_commands(tmp_path: Path) -> None:
    base = tmp_path / "base"
    declared_path.build(base, [])
    # a minimal Debian has a shell and coreutils, not iproute2 or file
    assert (base / "sh").exists() and (base / "timeout").exists()
    assert not (base / "ip").exists()
    assert not (base / "file").exists()
    with_ip = tmp_path / "ip"
    declared_path.build(with_ip, ["iproute2"])
    assert os.path.realpath(with_ip / "ip") == os.path.realpath(shutil.which("ip") or "")


def test_alternatives_count_by_their_real_file(tmp_path: Path) -> None:
    if shutil.which("iptables") is None:
        pytest.skip("iptables not installed")
    declared_path.build(tmp_path / "b", ["iptables"])
    # /usr/sbin/iptables is an alternatives link no package lists; its target is iptables'
    assert (tmp_path / "b" / "iptables").exists()


def test_undeclared_package_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not installed: no-such-package-xyz"):
        declared_path.build(tmp_path / "b", ["no-such-package-xyz"])


def test_vm_tool_check_names_file_and_strings(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    only = tmp_path / "bin"
    only.mkdir()
    for tool in ("qemu-system-x86_64", "busybox", "depmod", "apt-get", "apt-cache", "dpkg"):
        (only / tool).symlink_to("/bin/true")
    monkeypatch.setenv("PATH", str(only))
    missing = vm.missing_tools()
    assert [m.split()[0] for m in missing] == ["file", "strings"]
    assert "Debian package file" in missing[0] and "binutils" in missing[1]


def _makefile_packages() -> list[str]:
    """DEB_PKGS and BOOT_PKGS as the Makefile declares them (continuation lines joined)."""
    text = (Path(__file__).parents[1] / "Makefile").read_text().replace("\\\n", " ")
    pkgs: list[str] = []
    for line in text.splitlines():
        name, sep, value = line.partition(":=")
        if sep and name.strip() in ("DEB_PKGS", "BOOT_PKGS"):
            pkgs += value.split()
    return pkgs


def test_the_vm_tools_come_from_declared_packages(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """Every command lab/vm.py needs (apt-get and apt-cache fetch the kernel on a cold
    cache, which only a new machine has) is on the PATH make test builds from the
    Makefile's declarations, not merely somewhere on this machine."""
    pkgs = _makefile_packages()
    assert "apt" in pkgs and "qemu-system-x86" in pkgs, pkgs
    declared_path.build(tmp_path / "b", pkgs)
    monkeypatch.setenv("PATH", str(tmp_path / "b"))
    assert vm.missing_tools() == []
