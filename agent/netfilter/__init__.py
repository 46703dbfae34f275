"""Reading and walking iptables rules (both backends)."""
