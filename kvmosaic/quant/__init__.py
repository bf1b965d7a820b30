"""KV-cache quantization: int8 / int4 (per token, per KV head, asymmetric) and Oaken.

Every quantizer is a pair of pure tensor functions that turn K or V rows
``[N, Hk, D]`` into fixed-size byte records ``[N, R]`` and back. One record
holds one token of one layer's K (or V): codes, scales and, for Oaken, the
sparse outlier list, so paged blocks of records move as a whole (swap,
copy-on-write, prefix caching) with nothing stored beside them.
"""

from kvmosaic.quant.format import KV_CACHE_DTYPES, KVFormat

__all__ = ["KV_CACHE_DTYPES", "KVFormat"]
