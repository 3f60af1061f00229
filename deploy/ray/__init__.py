"""Ray deployment: ``pdcluster ray up|down|status`` (see deploy/README.md)."""
