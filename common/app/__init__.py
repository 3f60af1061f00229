"""The commands: the ``pdcluster`` CLI, ``up`` (a local cluster) and its supervisor, the offline model generator,
and process plumbing every long-running process shares (event loop, start-up heap freeze)."""
