"""Services, Ingresses and this Node kept current by list+watch (see ``reflector``).

The daemon's cycle reads the informer's memory instead of asking the API server; a change
the diagnosis can see wakes the daemon at once. One-shot commands keep a single LIST.
"""

from agent.kubewatch.informer import KubeInformer
from agent.kubewatch.reflector import JitteredBackoff, Reflector

__all__ = ["JitteredBackoff", "KubeInformer", "Reflector"]
