"""What a serving front (the router, a node's front process) shares: HTTP streaming (server-sent events, clients that
leave mid-response), a queue's drain rate for ``Retry-After``, and Prometheus collectors cheap per token."""
