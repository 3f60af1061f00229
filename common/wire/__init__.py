"""What crosses the network between router and nodes, below the request APIs: the Mux frames and socket, TLS, the
cluster secret and the worker credential."""
