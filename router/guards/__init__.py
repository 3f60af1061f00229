"""What stands in front of the router's services: the admin token, the client API keys, and the gRPC parse guard."""
