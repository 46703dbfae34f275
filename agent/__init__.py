"""loopback-agent: finds CLB loopback on a Kubernetes node and says why and what to do."""

__version__ = "0.1.0"
