"""The router's tokenizer: the HF tokenizer with a fast path and its caches, and the pool of worker processes that
tokenize large prompts off the event loop."""
