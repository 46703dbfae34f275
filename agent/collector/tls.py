"""TLS for the collector: a certificate and key from files, reloaded when they change
(cert-manager and mounted Secrets replace them in place, without restarting pods)."""

from __future__ import annotations

import logging
import os
import ssl
import stat
import tempfile
import threading
import time
from pathlib import Path

from agent.logfmt import LOGGER
from agent.regular_file import read_regular

MAX_PEM_BYTES = 1 << 20  # a certificate chain or key file; anything bigger is not one
log = logging.getLogger(LOGGER + ".collector")


class TLSFiles:
    """The server's SSLContext, rebuilt from the files when they change.

    A new context is built and checked whole before it replaces the old one: a
    half-rotated pair (the new certificate, the old key) keeps the old pair in service
    until both files agree. Checked at most every ``every`` seconds, on new connections.
    """

    def __init__(self, cert: str, key: str, every: float = 1.0) -> None:
        self.cert, self.key, self.every = cert, key, every
        self._lock = threading.Lock()
        self._stamp = self._files_stamp()
        self._context = self._load()  # at startup a bad pair is an error, not a warning
        self._checked = time.monotonic()
        self._said = ""  # the last problem reported: said once, not every second
        self.reloads = 0

    def _files_stamp(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for path in (self.cert, self.key):
            st = os.stat(path)  # follows the symlinks a Secret volume swaps
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{path}: not a regular file")
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

    def _load(self) -> ssl.SSLContext:
        """Read as the token file is (agent.regular_file: a FIFO or device swapped in
        never blocks the event loop that asks), then handed to OpenSSL from a private
        copy (it loads a chain from a path only)."""
        cert, _ = read_regular(self.cert, MAX_PEM_BYTES)
        key, _ = read_regular(self.key, MAX_PEM_BYTES)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        with tempfile.TemporaryDirectory(prefix="lb-tls-") as d:  # mode 0700
            (Path(d) / "cert.pem").write_bytes(cert)
            key_path = Path(d) / "key.pem"
            key_path.touch(mode=0o600)
            key_path.write_bytes(key)
            ctx.load_cert_chain(Path(d) / "cert.pem", key_path)
        return ctx

    def context(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now - self._checked >= self.every and self._lock.acquire(blocking=False):
            try:
                self._checked = now
                self._maybe_reload()
            finally:
                self._lock.release()
        return self._context

    def _maybe_reload(self) -> None:
        try:
            stamp = self._files_stamp()
            if stamp == self._stamp:
                return
            ctx = self._load()
        except (OSError, ssl.SSLError) as e:
            said = f"TLS files {self.cert}, {self.key}: {e}"
            if said != self._said:
                log.warning(f"{said}; still serving the previous certificate")
                self._said = said
            return
        self._context, self._stamp, self._said = ctx, stamp, ""
        self.reloads += 1
        log.info(f"TLS certificate reloaded from {self.cert}")
