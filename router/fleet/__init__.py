"""The router's view of its workers: who they are (``Worker``, ``Registry``), whether they may serve (membership
proof, sane reported facts, health, circuit breaker: ``monitor`` keeps them current), their load per DP rank and
what this router holds on them (leases), and what routing reads of each role (``candidates``)."""
