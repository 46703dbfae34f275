"""Watching NodePort handshakes on the node (read-only: AF_PACKET, counters, logs)."""
