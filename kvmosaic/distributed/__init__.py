"""Distributed KV cache after Infinite-LLM: instances on Ray lend each other KV blocks.

- ``lending``: the verbs an instance applies to its own engine's KV books (lend, reclaim, recompute)
- ``ledger`` / ``gmanager``: liveness, the global debt ledger, DGFM cycle search (the gManager actor)
- ``rmanager``: per-instance borrowing and lending of rBlocks
- DistAttention (micro-attention on the creditors, merged on the debtor) is an attention backend:
  ``kvmosaic.attention.dist_attention``
- ``instance`` / ``cluster`` / ``swaps``: the Ray actors, the front end, and cycle resolution

Ray is imported only by the modules that need it; ``ledger`` is plain Python.
"""
