"""The engine of one scheduler rank: requests, batches, KV pools and prefix cache (``mem``), the scheduler loop and
its policies, the model runner and models (``model``), sampling, kernels, overlap and CUDA graphs. Both node roles
and the colocated server run it; it knows nothing of KV transfer, fronts or the router."""
