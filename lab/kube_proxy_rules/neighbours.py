"""kube-proxy's neighbours on a node: ip-masq-agent and a plain CNI masquerade rule."""


from __future__ import annotations

from collections.abc import Sequence

from lab.kube_proxy_rules.common import _BUILTIN, _render_save, _save_quote

# --- neighbours: ip-masq-agent and CNI -------------------------------------------------


def ip_masq_agent(nonmasq_cidrs: Sequence[str], *, masq_link_local: bool = False) -> str:
    """kubernetes-sigs/ip-masq-agent's nat rules (syncMasqRules), iptables-save rendering:
    the appended POSTROUTING jump for non-LOCAL destinations, a RETURN per
    non-masquerade CIDR (link-local first unless masqLinkLocal), a final MASQUERADE."""
    chain = "IP-MASQ-AGENT"
    jump_comment = ("ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination "
                    f"traffic to our custom {chain} chain")
    tables: dict[str, dict[str, list[str]]] = {"nat": {c: [] for c in _BUILTIN["nat"]}}
    nat = tables["nat"]
    nat["POSTROUTING"].append(f"-A POSTROUTING -m comment --comment {_save_quote(jump_comment)} "
                              f"-m addrtype ! --dst-type LOCAL -j {chain}")
    rules = nat.setdefault(chain, [])
    cidrs = ([] if masq_link_local else ["169.254.0.0/16"]) + list(nonmasq_cidrs)
    for cidr in cidrs:
        rules.append(f"-A {chain} -d {cidr} -m comment --comment "
                     '"ip-masq-agent: local traffic is not subject to MASQUERADE" -j RETURN')
    rules.append(f"-A {chain} -m comment --comment "
                 '"ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in '
                 'chain)" -j MASQUERADE --random-fully')
    return _render_save(tables, backend=None)


def cni_masquerade(pod_cidr: str) -> str:
    """A bridge-plugin style (ipMasq) rule: pod traffic leaving the pod network is
    masqueraded, whatever kube-proxy decided."""
    tables = {"nat": {c: [] for c in _BUILTIN["nat"]}}
    tables["nat"]["POSTROUTING"].append(
        f"-A POSTROUTING -s {pod_cidr} ! -d {pod_cidr} -m comment --comment "
        '"cni: masquerade pod traffic leaving the pod network" -j MASQUERADE')
    return _render_save(tables, backend=None)


def merge_restore(*fragments: str) -> str:
    """Merge iptables-save/-restore texts into one iptables-restore input: per table the
    union of chains (first policy wins) and every fragment's rules appended in order,
    grouped per chain as iptables-save does; one COMMIT per table."""
    tables: dict[str, dict[str, list[str]]] = {}
    policies: dict[str, dict[str, str]] = {}
    for text in fragments:
        table: str | None = None
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("*"):
                table = line[1:]
                tables.setdefault(table, {})
                policies.setdefault(table, {})
            elif line == "COMMIT":
                table = None
            elif table is None:
                raise ValueError(f"rule outside a table: {line!r}")
            elif line.startswith(":"):
                name, policy = line[1:].split()[:2]
                tables[table].setdefault(name, [])
                policies[table].setdefault(name, policy)
            elif line.startswith("-A "):
                chain = line.split(None, 2)[1]
                tables[table].setdefault(chain, []).append(line)
                policies[table].setdefault(
                    chain, "ACCEPT" if chain in _BUILTIN.get(table, ()) else "-")
            else:
                raise ValueError(f"unsupported line in a restore fragment: {line!r}")
    out: list[str] = []
    for table, chains in tables.items():
        builtins = [c for c in _BUILTIN.get(table, ()) if c in chains]
        users = sorted(c for c in chains if c not in builtins)
        out.append("*" + table)
        out.extend(f":{c} {policies[table][c]} [0:0]" for c in builtins + users)
        for c in builtins + users:
            out.extend(chains[c])
        out.append("COMMIT")
    return "\n".join(out) + "\n"


