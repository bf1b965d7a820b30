"""Attention and the KV cache it reads: one room for the paged K/V tensors, what a step tells
attention about its batch, and every backend that writes and attends over them.

- ``kv_cache``: the physical blocks (device pool, host swap tier, a draft's companion pool)
- ``metadata``: ``AttentionMetadata`` / ``PrefillSpan`` of a packed batch; ``rotary``: the position rotation
  the backends apply to q and k as they write the cache
- ``backend``: the ``AttentionBackend`` interface the model calls
- ``paged`` / ``quantized``: compute-dtype caches (PyTorch reference, C++ kernels) and int8 / int4 /
  Oaken records; ``build.make_attention_backend`` picks one, once per worker
- ``pool_rows`` / ``merge``: a pool lent to other instances as float rows, and partial attention with
  its exact merge; ``dist_attention``: the backend over blocks held on several instances
"""
