"""The collector: verdicts from every node in, the fleet view out."""
