"""One attempt at serving a routed request and what follows it: the RPC legs on the chosen workers, the output
streamed through the request's ``OutputState``, and after a failed attempt a retry or a migration."""
