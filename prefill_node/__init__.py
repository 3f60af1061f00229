"""The prefill node: prefills prompts and sends their KV to the decode node that holds the same bootstrap room.

Lifecycle of a request on a prefill rank::

    bootstrap queue --(decode sent its destination pages)--> waiting queue --(PrefillAdder)--> running prefill
      (chunk by chunk; each finished chunk's pages go to the KVSender) --(last chunk + first token)-->
    inflight queue --(KVPoll.Success)--> KV released into the radix cache (unlocked), Prefill RPC returns
"""
