"""The decode node: receives a request's KV from its prefill node, then generates the rest of its tokens.

Lifecycle of a request on a decode rank::

    prealloc queue --(bootstrapped and the KV budget allows: slot + pages allocated, page indices sent)-->
    transfer queue --(KVPoll.Success: first token from the metadata)--> running decode batch --> finished
    (retracted under memory pressure: back to the scheduler's waiting queue, recomputed locally; nothing is lost)
"""
