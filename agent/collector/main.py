"""`loopback-agent collector`: open the store, choose who may post, serve until SIGTERM,
prune the history every hour. Its messages are lines on stderr with a level, its access
log lines on stdout (agent.logfmt, agent.collector.access; the command set the format)."""

from __future__ import annotations

import argparse
import logging
import signal
import ssl
import sys
import threading
from typing import Any

from agent.logfmt import LOGGER, stream_logger
from agent.signals import SignalEvents

EXIT_USAGE = 64  # as agent.cli (sysexits.h)
EXIT_CANTCREAT = 73
log = logging.getLogger(LOGGER + ".collector")


class StartError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def authenticator(args: argparse.Namespace) -> Any:
    """None (the shared token or nobody, as --token-file says) or the TokenReview one."""
    mode = getattr(args, "auth", "shared-token")
    if mode not in ("shared-token", "kube-token"):  # from LOOPBACK_AGENT_AUTH
        raise StartError(EXIT_USAGE, f"--auth {mode!r}: shared-token or kube-token")
    if mode != "kube-token":
        return None
    from agent.collector.auth import KubeTokenReview
    from agent.probes.base import ProbeContext
    from agent.probes.kube_api import KubeUnavailable, api_client

    if args.token_file:
        raise StartError(EXIT_USAGE, "--auth kube-token verifies each agent's own token: "
                                     "--token-file is for --auth shared-token")
    try:
        api = api_client(ProbeContext(kubeconfig=args.kubeconfig, timeout=5.0))
    except KubeUnavailable as e:
        raise StartError(EXIT_USAGE, f"--auth kube-token needs the Kubernetes API: {e}") \
            from None
    return KubeTokenReview(api, audience=args.kube_audience,
                           service_account=args.agent_service_account,
                           ttl=float(getattr(args, "token_review_cache", 60.0)))


def shown_db(db: str) -> str:
    """The --db URL as a message may show it: no password, neither in its user part
    (`postgresql://u:secret@host/db`, a password holding `/` too: the user part ends at
    the last `@`) nor in its query (`?password=secret`)."""
    scheme, sep, rest = db.partition("://")
    if not sep:
        return db  # a path (SQLite): no password in it
    main, q, query = rest.partition("?")
    if "@" in main:
        userinfo, host = main.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        main = f"{user}:***@{host}" if ":" in userinfo else f"{user}@{host}"
    if q:
        query = "&".join(f"{k}=***" if "pass" in k.lower() else kv
                         for kv in query.split("&") for k in (kv.partition("=")[0],))
    return f"{scheme}://{main}{q}{query}"


def _access_log(fmt: str, on: bool) -> Any:
    """The access log (a line per request on stdout, in the log format), or None."""
    from agent.collector import access

    if not on:
        return None
    return access.AccessLog(stream_logger(access.LOGGER, fmt, sys.stdout, on=True))


def run(args: argparse.Namespace) -> int:
    from agent.collector.store import open_store
    from agent.collector.web import serve

    tls_cert, tls_key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if bool(tls_cert) != bool(tls_key):
        raise StartError(EXIT_USAGE, "--tls-cert and --tls-key go together")
    auth = authenticator(args)
    db = args.db
    try:
        store = open_store(db, retention_days=args.retention_days,
                           node_quota=int(getattr(args, "node_quota_mb", 64)) << 20)
    except ImportError as e:
        raise StartError(EXIT_USAGE,
                         f"{shown_db(db)}: {e} (pip install 'loopback-agent[postgres]')") \
            from e
    except Exception as e:
        raise StartError(EXIT_CANTCREAT, f"{shown_db(db)}: {type(e).__name__}: {e}") from e
    try:
        server = serve(args.listen, store, args.token_file, tls_cert=tls_cert,
                       tls_key=tls_key, authenticator=auth,
                       access_log=_access_log(getattr(args, "log_format", "json"),
                                              bool(getattr(args, "access_log", True))))
    except ssl.SSLError as e:  # not a certificate, or the key does not match it
        raise StartError(EXIT_USAGE, f"TLS: {tls_cert}, {tls_key}: {e}") from e
    except OSError as e:
        what = f"cannot listen on {args.listen}" if e.filename is None else \
            f"TLS: cannot read {e.filename}"
        raise StartError(EXIT_CANTCREAT, f"{what}: {e.strerror or e}") from e
    stop = threading.Event()
    signals = SignalEvents((signal.SIGTERM, signal.SIGINT), stop)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    scheme = "https" if tls_cert else "http"
    where = f"[{host}]" if ":" in host else host
    url = f"{scheme}://{where}:{port}/"
    log.info(f"collector on {url} ({shown_db(db)})",
             extra={"fields": {"url": url, "db": shown_db(db)}})
    if auth is not None and not tls_cert:
        log.warning("--auth kube-token without TLS: agents' tokens cross the network in "
                    "clear text")
    while not stop.wait(3600):
        store.prune()
    signals.close()
    server.shutdown()
    store.close()
    return 0
