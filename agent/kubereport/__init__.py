"""The verdict written back to the cluster (opt-in): a Node condition and Warning Events
(``writer``), and node-problem-detector's plugin answer (``condition.npd_result``)."""

from agent.kubereport.condition import Condition, condition_of, npd_result
from agent.kubereport.writer import KubeReporter

__all__ = ["Condition", "KubeReporter", "condition_of", "npd_result"]
