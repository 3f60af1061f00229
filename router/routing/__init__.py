"""Where a request goes: a prefill and a decode worker (or one colocated worker) picked by the policies, their DP
ranks, and a bootstrap room; a request no decode worker has room for waits in line (``hold``)."""
