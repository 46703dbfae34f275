"""The collector over TLS, as a real process with certificates made by openssl: it serves
the certificate it was given, picks up a replaced one without a restart, keeps the old
one while the files are half rotated, and a client that never says hello blocks no one."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.test_collector import Proc, free_port, verdict


def make_cert(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (subject CN=name) and its key."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
                    f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def served_cert(port: int) -> bytes:
    """The certificate the server presents (DER), whoever signed it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s, \
            ctx.wrap_socket(s) as tls:
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return der


def der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


def replace(src: Path, dst: Path) -> None:
    """As a Secret volume does: the new file appears whole, by rename."""
    tmp = dst.with_suffix(".new")
    tmp.write_bytes(src.read_bytes())
    os.replace(tmp, dst)


def serving_first(tmp_path: Path, certs: dict[str, tuple[Path, Path]]
                  ) -> tuple[Proc, Path, Path]:
    """A collector serving the "first" pair from tls.crt / tls.key (it checks it does)."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    replace(certs["first"][0], cert)
    replace(certs["first"][1], key)
    c = Proc(tmp_path / "c.db", extra=("--tls-cert", str(cert), "--tls-key", str(key)),
             verify=str(certs["first"][0]))
    assert served_cert(c.port) == der(certs["first"][0])
    return c, cert, key


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    return {n: make_cert(tmp_path, n) for n in ("first", "second")}


def test_https_serves_and_reloads_a_replaced_certificate(
        tmp_path: Path, certs: dict[str, tuple[Path, Path]]) -> None:
    c, cert, key = serving_first(tmp_path, certs)
    try:
        r = requests.post(c.url + "/v1/verdicts", json=verdict("tls-node"), timeout=5,
                          verify=str(certs["first"][0]))
        assert r.status_code == 200
        # half rotated: the new certificate, still the old key -> the old pair stays
        replace(certs["second"][0], cert)
        time.sleep(2.5)
        assert served_cert(c.port) == der(certs["first"][0])
        replace(certs["second"][1], key)
        deadline = time.monotonic() + 10
        while served_cert(c.port) != der(certs["second"][0]):
            assert time.monotonic() < deadline, "the replaced certificate was not served"
            time.sleep(0.3)
        r = requests.get(c.url + "/v1/nodes", timeout=5, verify=str(certs["second"][0]))
        assert [n["node"] for n in r.json()] == ["tls-node"]
        # plain HTTP to the TLS port: refused, and the server goes on
        with socket.create_connection(("127.0.0.1", c.port), timeout=5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(5)
            with contextlib.suppress(ConnectionResetError, TimeoutError):
                assert b"200" not in s.recv(4096)
        assert requests.get(c.url + "/healthz", timeout=5,
                            verify=str(certs["second"][0])).status_code == 200
    finally:
        err = c.stop()
    assert "certificate reloaded" in err and "still serving the previous" in err


def test_a_client_that_never_says_hello_blocks_no_one(
        tmp_path: Path, certs: dict[str, tuple[Path, Path]]) -> None:
    cert, key = certs["first"]
    c = Proc(tmp_path / "c.db", extra=("--tls-cert", str(cert), "--tls-key", str(key)),
             verify=str(cert))
    silent = [socket.create_connection(("127.0.0.1", c.port)) for _ in range(30)]
    try:
        for _ in range(10):
            t0 = time.monotonic()
            assert requests.get(c.url + "/healthz", timeout=5, verify=str(cert)).ok
            assert time.monotonic() - t0 < 0.5
        silent[0].settimeout(15)
        t0 = time.monotonic()
        assert silent[0].recv(1) == b""  # hung up on within the header deadline
        assert time.monotonic() - t0 < 12
    finally:
        for s in silent:
            s.close()
        c.stop()


def test_unusable_tls_files_stop_the_start_with_a_reason(
        tmp_path: Path, certs: dict[str, tuple[Path, Path]]) -> None:
    def start(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agent", "collector", "--listen",
                               f"127.0.0.1:{free_port()}", "--db",
                               f"sqlite://{tmp_path / 'x.db'}", *extra],
                              capture_output=True, text=True, timeout=30)

    r = start("--tls-cert", str(certs["first"][0]), "--tls-key", str(certs["second"][1]))
    assert r.returncode == 64 and "TLS" in r.stderr and "Traceback" not in r.stderr
    r = start("--tls-cert", str(tmp_path / "missing.crt"), "--tls-key", str(certs["first"][1]))
    assert r.returncode == 73 and "missing.crt" in r.stderr
    r = start("--tls-cert", str(certs["first"][0]))
    assert r.returncode == 64 and "go together" in r.stderr
    env = {**os.environ, "LOOPBACK_AGENT_TLS_CERT": str(certs["first"][0]),
           "LOOPBACK_AGENT_TLS_KEY": str(certs["second"][1])}
    r = subprocess.run([sys.executable, "-m", "agent", "collector", "--listen",
                        f"127.0.0.1:{free_port()}", "--db", f"sqlite://{tmp_path / 'y.db'}"],
                       capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 64 and "TLS" in r.stderr  # the variables are read too


def test_a_certificate_replaced_by_a_fifo_blocks_nothing(
        tmp_path: Path, certs: dict[str, tuple[Path, Path]]) -> None:
    """issue 35, item 6: the reload opened the TLS files as they were (the token file is
    read without blocking, the TLS files were not): a FIFO in the certificate's place
    blocked the event loop on the reload, every connection timed out and SIGTERM took
    ~30 s. Now the previous certificate stays in service and says why."""
    c, cert, _ = serving_first(tmp_path, certs)
    try:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        os.replace(fifo, cert)  # by rename, as a Secret volume swaps files
        time.sleep(2.5)  # past the reload check (every 1 s)
        for _ in range(3):
            t0 = time.monotonic()
            r = requests.get(c.url + "/healthz", timeout=5, verify=str(certs["first"][0]))
            assert r.status_code == 200 and time.monotonic() - t0 < 2
        assert served_cert(c.port) == der(certs["first"][0])
        t0 = time.monotonic()
    finally:
        err = c.stop()
    assert time.monotonic() - t0 < 10, "SIGTERM was slow"
    assert "not a regular file" in err and "still serving the previous" in err
