"""Test and benchmark support shared by ``tests/`` and ``benchmarks/`` (neither imports the other).

- ``mock_worker``: a mock ``pdcluster.v1.Worker`` in any role, and a mock fleet in one process.
- ``router_fleet``: a mock fleet behind an in-process ``RouterServer``.

KV transfer test support lives in ``kvtransfer/testing.py`` (``common`` imports nothing of ``kvtransfer``).
Nothing here is imported by the serving processes.
"""
