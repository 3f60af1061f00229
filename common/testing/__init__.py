"""Test and benchmark support shared by ``tests/`` and ``benchmarks/`` (neither imports the other).

- ``mock_worker``: a mock ``pdcluster.v1.Worker`` in any role, and a mock fleet in one process.
- ``router_fleet``: a mock fleet behind an in-process ``RouterServer``.
- ``kvtransfer_helpers``: synthetic KV pools, room plans, and prefill/decode roles in child processes.

Nothing here is imported by the serving processes.
"""
