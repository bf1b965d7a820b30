"""An HF directory of a model shape with random weights: what vLLM and HF read and llama.cpp converts.

Matrices are normal with std 0.02 (the configs' initializer_range), norms are ones and biases zeros,
all bfloat16. Each tensor has its own generator seeded from the run's seed and the tensor's name,
so a tensor's values do not depend on which others are written. Tensors are generated in row
chunks and written in shards of at most ``SHARD_BYTES``, so a 3B model needs well under 1 GB of RAM
beyond one shard. The tokenizer is the embedded default model's (byte-level BPE, 49,152 tokens);
a config whose vocabulary is larger keeps its size, and llama.cpp's converter pads the GGUF token
list with [PAD<id>] tokens as it does for any such checkpoint. Runs in the main venv.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import torch
from peer_runners.shapes import ModelShape
from safetensors.torch import save_file

SEED = 57
STD = 0.02
SHARD_BYTES = 2 << 30
CHUNK_ELEMENTS = 1 << 24  # rows generated at a time: a 64 MiB float32 scratch


def tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def random_tensor(name: str, shape: tuple[int, ...], seed: int = SEED) -> torch.Tensor:
    """A bfloat16 tensor: ones for norms, zeros for biases, N(0, STD^2) for matrices."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    out = torch.empty(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(tensor_seed(seed, name))
    rows = max(1, CHUNK_ELEMENTS // max(1, out[0].numel()))
    for start in range(0, shape[0], rows):
        chunk = out[start:start + rows]
        chunk.copy_(torch.randn(chunk.shape, generator=generator).mul_(STD))
    return out


def shard_plan(shapes: dict[str, tuple[int, ...]], shard_bytes: int = SHARD_BYTES,
               element_bytes: int = 2) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most ``shard_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = element_bytes
        for dim in shape:
            nbytes *= dim
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(shape: ModelShape, out_dir: Path, seed: int = SEED) -> None:
    """model-0000k-of-0000n.safetensors shards and their model.safetensors.index.json."""
    shapes = shape.tensor_shapes()
    shards = shard_plan(shapes)
    weight_map, total = {}, 0
    for k, names in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(name, shapes[name], seed) for name in names}
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def write_hf_dir(shape: ModelShape, out_dir: Path, seed: int = SEED) -> Path:
    """The whole directory, written to a temporary sibling and renamed (a half-made one never counts)."""
    from kvmosaic.model.gguf_file import GGUFFile
    from kvmosaic.model.hf_loader import hf_model_config, write_tokenizer_files
    from kvmosaic.model.loader import default_model_path
    from kvmosaic.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFFile(default_model_path()).fields)
    eos = list(tokenizer.eos_token_ids)
    config = shape.hf_config(tokenizer.bos_token_id, eos[0] if len(eos) == 1 else eos or None)
    model_config = hf_model_config(config)  # kvmosaic's own reader must accept what it is given
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    write_tokenizer_files(tokenizer, model_config, tmp)
    write_weights(shape, tmp, seed)
    tmp.rename(out_dir)
    return out_dir
