"""Getting verdicts off the node: durable spool, shipping to the collector."""
