"""Secure aggregation (issue 40): the coordinator learns the weighted sum of the sites' quantised
pseudo-gradients and nothing else about any one of them.

A library with an in-process protocol, no transport: :mod:`.site_round` and
:mod:`.coordinator_round` are the two ends' state machines for one aggregation (a run's round and
fragment), speaking the typed messages of :mod:`.messages`. docs/security.md has the design, the
threat model and the plan that carries these messages over gRPC.
"""
