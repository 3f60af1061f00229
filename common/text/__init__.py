"""Tokenizer loading and incremental detokenization, shared by the router, the node fronts and the engine."""
