"""What a run's weights and KV cache take, next to its peak RSS (the issue's target: RSS <= weights +
KV pool + 15%), and the bytes a decode step must read (the roofline's numerator). Runs in the main venv.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RSS_ALLOWANCE = 1.15  # RSS may exceed weights + KV pool by this factor
GB = 1e9


@dataclass(frozen=True, slots=True)
class WeightBytes:
    held: int  # the weights as the model file stores them (or as a float dtype holds an HF directory)
    read_per_token: int  # what one decode step reads: all but an untied token-embedding table


def _gguf_bytes(path: Path) -> WeightBytes:
    from kvmosaic.model.gguf_file import GGUFFile

    tensors = GGUFFile(path).tensors
    held = sum(t.n_bytes for t in tensors)
    untied = any(t.name == "output.weight" for t in tensors)
    embedding = sum(t.n_bytes for t in tensors if t.name == "token_embd.weight")
    return WeightBytes(held, held - embedding if untied else held)


def _hf_dir_bytes(path: Path, dtype: str) -> WeightBytes:
    """Every tensor of the directory's safetensors (header only) at ``dtype``'s bytes per element."""
    from safetensors import safe_open

    from kvmosaic.planner.roofline import dtype_bytes

    element = dtype_bytes(dtype)
    numel: dict[str, int] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 -- safe_open handles are not iterable
                size = 1
                for dim in shard.get_slice(name).get_shape():
                    size *= dim
                numel[name] = size
    held = int(sum(numel.values()) * element)
    embedding = int(numel.get("model.embed_tokens.weight", 0) * element)
    return WeightBytes(held, held - embedding if "lm_head.weight" in numel else held)


def weights_bytes(path: Path | None, dtype: str) -> WeightBytes | None:
    """The weights of a run's model file (None: the embedded default model); None where not known."""
    if path is None:
        from kvmosaic.model.loader import default_model_path

        path = Path(default_model_path())
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_bytes(path)
    if path.is_dir() and any(path.glob("*.safetensors")):
        return _hf_dir_bytes(path, dtype)
    return None


def kv_element_bytes(engine: str, dtype: str) -> int:
    """Bytes per cached K or V element: llama.cpp keeps an f16 cache; the others cache in the activation
    dtype (float32 under a GGUF weight format)."""
    if engine == "llamacpp":
        return 2
    return 2 if dtype == "bfloat16" else 4


def rss_ratio(rss: int | None, weights: int | None, kv_pool: int | None) -> float | None:
    """Peak RSS over weights + KV pool (a pool not reported counts as 0); None without the figures."""
    if not rss or not weights:
        return None
    return rss / (weights + (kv_pool or 0))


def rss_lines(results: list[dict]) -> list[str]:
    """One line per run with a peak RSS: RSS, weights, KV pool and their ratio against the allowance."""
    rows = [r for r in results if r.get("peak_rss_bytes")]
    if not rows:
        return []
    lines = [f"peak RSS per run (runner process and its workers) against weights + KV pool (target <= "
             f"{RSS_ALLOWANCE:.2f}x):"]
    for r in sorted(rows, key=lambda r: (r["workload"], r["dtype"], r["engine"])):
        ratio = rss_ratio(r["peak_rss_bytes"], r.get("weights_bytes"), r.get("kv_pool_bytes"))
        kv = r.get("kv_pool_bytes")
        lines.append(f"  {r['workload']} {r['dtype']:9} {r['engine']:9} RSS {r['peak_rss_bytes'] / GB:.2f} GB; weights "
                     + (f"{r['weights_bytes'] / GB:.2f} GB" if r.get("weights_bytes") else "n/a")
                     + (f" + KV pool {kv / GB:.2f} GB" if kv else " + KV pool n/a")
                     + (f" -> {ratio:.2f}x" + ("" if ratio <= RSS_ALLOWANCE else " (over)") if ratio else ""))
    return lines
