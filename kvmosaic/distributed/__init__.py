"""Distributed KV cache after Infinite-LLM: instances on Ray lend each other KV blocks.

- ``merge``: partial attention and its exact merge (pure tensor functions)
- ``ledger`` / ``gmanager``: liveness, the global debt ledger, DGFM cycle search (the gManager actor)
- ``rmanager``: per-instance borrowing and lending of rBlocks
- ``dist_attention``: micro-attention on the creditors, merged on the debtor
- ``instance`` / ``cluster`` / ``swaps``: the Ray actors, the front end, and cycle resolution

Ray is imported only by the modules that need it; ``merge`` and ``ledger`` are plain Python/PyTorch.
"""
