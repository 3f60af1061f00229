"""Test and benchmark support shared by ``tests/`` and ``benchmarks/`` (neither imports the other).

- ``mock_worker``: a mock ``pdcluster.v1.Worker`` in any role, and a mock fleet in one process.
A mock fleet behind an in-process ``RouterServer`` lives in ``router/testing.py`` and KV transfer test support in
``kvtransfer/testing.py`` (``common`` imports neither ``router`` nor ``kvtransfer``).
Nothing here is imported by the serving processes.
"""
