"""Which bearer token the agent shows the collector (`run --collector-auth MODE`).

- ``shared-token``, the simple mode: one token for the whole fleet, from a Secret
  (``--token-file``). Whoever holds it may post a verdict for any node name.
- ``kube-token``: the pod's own service-account token, projected by the kubelet with the
  collector's audience (KUBE_TOKEN_AUDIENCE) and a short lifetime. The collector asks the
  TokenReview API whose it is and accepts a verdict only for the node that pod runs on,
  so a node can speak only for itself, and a token stolen from it expires within minutes
  and is useless against the Kubernetes API (wrong audience).

On the agent's side both are a bearer token in a file, re-read when it changes (the kubelet
refreshes a projected token at 80 % of its lifetime); the modes differ in which file is
the default. ``--token-file`` (or LOOPBACK_AGENT_TOKEN_FILE) always wins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

SHARED_TOKEN = "shared-token"
KUBE_TOKEN = "kube-token"
MODES = (SHARED_TOKEN, KUBE_TOKEN)
KUBE_TOKEN_AUDIENCE = "loopback-agent-collector"
KUBE_TOKEN_FILE = "/var/run/secrets/loopback-agent/token"  # the DaemonSet's projected volume
_TOKEN_FILE_ENV = "LOOPBACK_AGENT_TOKEN_FILE"
_GIVEN = "_token_file_given"  # set on the namespace when --token-file was on the line


def auth_mode(text: str) -> str:
    if text not in MODES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(MODES)}")
    return text


def default_token_file(mode: str, env: Mapping[str, str] = os.environ) -> str | None:
    """The token file when none is named on the command line."""
    if env.get(_TOKEN_FILE_ENV):
        return env[_TOKEN_FILE_ENV]
    return KUBE_TOKEN_FILE if mode == KUBE_TOKEN else None


def env_mode(env: Mapping[str, str] = os.environ) -> str:
    """The mode LOOPBACK_AGENT_COLLECTOR_AUTH names (shared-token when unset or invalid:
    an invalid value is refused with exit 64 by the option itself)."""
    value = env.get("LOOPBACK_AGENT_COLLECTOR_AUTH", SHARED_TOKEN)
    return value if value in MODES else SHARED_TOKEN


class CollectorAuthOption(argparse.Action):
    """--collector-auth MODE: also makes MODE's default the token file, unless a token
    file was named (command line or environment)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        if not getattr(namespace, _GIVEN, False):
            namespace.token_file = default_token_file(str(values))


class TokenFileOption(argparse.Action):
    """--token-file F: remembered as given, so --collector-auth after it keeps it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, _GIVEN, True)
