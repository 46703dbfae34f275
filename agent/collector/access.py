"""The collector's access log (issue 37): a line per HTTP request on stdout, at level
info, in the process's log format (agent.logfmt)::

    {"ts":"...","level":"info","msg":"request","method":"POST","path":"/v1/verdicts",
     "status":200,"bytes":35,"bytes_in":2711,"duration_ms":3.1,"remote":"10.0.3.7",
     "node":"node-a"}

What a line holds: the method; the path without its query string, and of the query only
the paging and filter parameters the views take (offset, limit, before, status,
finding, service, lb_ip): anything else a client puts
there (a token where it does not belong) is not written, nor is any header (the
Authorization header never); the status; the reply's bytes (its Content-Length) and the
request's announced ones; the time from the request's headers to the end of the reply;
the client's address (the socket's: no X-Forwarded-For); for a POST of verdicts, the
node they are for (a batch for several: the first, and ``nodes``, how many). Every string
goes through agent.logfmt (cut, escaped: a node name with a terminal escape in it shows
it as ``\\x1b``).

A line is written (and flushed) when its request ends, not buffered: a flood of requests
costs lines, never memory; ``--access-log off`` (LOOPBACK_AGENT_ACCESS_LOG=off) writes
none. Requests that never reach a handler (a malformed request line Tornado refuses, a
client gone before its reply) have no line.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlencode

from agent import logfmt

LOGGER = logfmt.LOGGER + ".access"
# paging and the fleet page's filters: what the GET views take (nothing secret)
QUERY_KEPT = ("offset", "limit", "before", "status", "finding", "service", "lb_ip")
_PATH_CHARS = 512
_QUERY_VALUE_CHARS = 64


class AccessLog:
    """Tornado's ``log_function``: called with the handler when its request ends."""

    def __init__(self, logger: logging.Logger) -> None:
        self.log = logger

    def __call__(self, handler: Any) -> None:
        if not self.log.isEnabledFor(logging.INFO):
            return
        try:
            fields = request_fields(handler)
        except Exception as e:  # never the request's failure: the line says what it can
            fields = {"access_log_error": f"{type(e).__name__}: {e}"}
        self.log.info("request", extra={"fields": fields})


def request_fields(handler: Any) -> dict[str, Any]:
    req = handler.request
    fields: dict[str, Any] = {"method": req.method, "path": req.path[:_PATH_CHARS]}
    kept = [(k, v.decode("utf-8", "replace")[:_QUERY_VALUE_CHARS])
            for k in QUERY_KEPT for v in req.query_arguments.get(k, ())[:2]]
    if kept:
        fields["query"] = urlencode(kept)
    fields["status"] = handler.get_status()
    sent = getattr(handler, "_headers", {}).get("Content-Length")  # set by finish()
    if sent is not None and str(sent).isdigit():
        fields["bytes"] = int(sent)
    announced = req.headers.get("Content-Length")
    if announced is not None and announced.isdigit() and len(announced) <= 12:
        fields["bytes_in"] = int(announced)
    fields["duration_ms"] = round(req.request_time() * 1000, 1)
    fields["remote"] = req.remote_ip
    if req.method == "POST":
        caller = getattr(handler, "caller", None)
        col = getattr(handler, "col", None)
        posted = col.posted_node(caller) if caller is not None and col is not None and \
            hasattr(col, "posted_node") else None
        if posted is not None:
            fields["node"] = posted[0]
            if posted[1] > 1:
                fields["nodes"] = posted[1]
        elif caller is not None and getattr(caller, "node", None):
            fields["node"] = caller.node  # a kube-token caller may post for its node only
    return fields
