"""What a request passes before it is routed: the router's request limit, the client's priority ceiling, and input
processing (model, sampling parameters, tokenization, context length)."""
