"""The router's end of ``Worker.Mux``: one long-lived stream per worker (a gRPC call or a Mux socket) carrying every
request's legs and the worker's pushed load reports. It knows nothing else of the router."""
