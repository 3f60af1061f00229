"""What crosses the network between router and nodes, below the request APIs: the Mux frames and socket, the cluster
secret and the worker credential (the TLS material they use is a basic: ``common/tls.py``)."""
