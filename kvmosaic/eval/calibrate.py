"""``kvmosaic calibrate-kv``: Oaken's offline profiling on a calibration text.

About 100 prompts are cut from the text and prefilled one at a time into an unquantized cache.
Each layer's key center (the mean key after rotary, per KV head and channel, over all prompts) is
taken first; with the key rotation (the default, ``kvmosaic.quant.rotation``) each layer's channel
scales are then taken from the centered keys and keys are rotated; then for every layer, separately
for K (as the cache stores it) and for V, each prompt's four thresholds are found by top-k and the
thresholds are averaged over the prompts. The sparse
capacity is then the smallest one that holds every outlier of ``capacity_quantile`` of the
calibration head vectors.
"""

from __future__ import annotations

import torch

from kvmosaic.eval.harness import EvalModel, eval_worker, run_sequence
from kvmosaic.quant.calibration import choose_capacity, outliers_per_vector, overflow_rate, run_thresholds
from kvmosaic.quant.rotation import DEFAULT_EXPONENT, DEFAULT_SEED, KeyRotation, channel_scales, random_signs
from kvmosaic.quant.thresholds import KVThresholds
from kvmosaic.worker.worker import Worker


def calibration_prompts(em: EvalModel, text: str, num_prompts: int, prompt_len: int) -> list[list[int]]:
    ids = em.loaded.tokenizer.encode(text, add_special_tokens=False)
    prompts = [ids[i: i + prompt_len] for i in range(0, len(ids) - prompt_len + 1, prompt_len)][:num_prompts]
    if not prompts:
        raise ValueError(f"the calibration text has fewer than {prompt_len} tokens")
    return prompts


@torch.inference_mode()
def collect_kv(worker: Worker, prompt: list[int]) -> list[torch.Tensor]:
    """Per layer the prompt's cached K and V rows, [2, n, Hk, D] float32 (an unquantized worker)."""
    run_sequence(worker, prompt, chunk=len(prompt))
    cfg = worker.model_config
    return [layer.reshape(2, -1, cfg.num_key_value_heads, cfg.head_dim)[:, : len(prompt)].float()
            for layer in worker.kv_cache.layer_pools()]


def calibrate(em: EvalModel, text: str, num_prompts: int = 100, prompt_len: int = 128, outer_ratio: float = 0.04,
              inner_ratio: float = 0.06, sparse_capacity: int | None = None, capacity_quantile: float = 0.99,
              source: str = "", key_rotation: bool = True, scale_exponent: float = DEFAULT_EXPONENT,
              rotation_seed: int = DEFAULT_SEED) -> KVThresholds:
    prompts = calibration_prompts(em, text, num_prompts, prompt_len)
    num_layers = em.loaded.config.num_hidden_layers
    worker = eval_worker(em, "auto", max(len(p) for p in prompts))
    kept = [collect_kv(worker, prompt) for prompt in prompts]
    k_center = torch.stack([torch.cat([kv[layer][0] for kv in kept]).mean(0) for layer in range(num_layers)])
    signs = k_scale = None
    head_dim = em.loaded.config.head_dim
    key_rotation = key_rotation and not head_dim & (head_dim - 1)  # the butterfly needs a power of two
    if key_rotation:
        signs = random_signs(head_dim, rotation_seed)
        k_scale = torch.stack([channel_scales(torch.cat([kv[layer][0] for kv in kept]) - k_center[layer],
                                              scale_exponent) for layer in range(num_layers)])
        rotations = [KeyRotation.of(signs, k_scale[layer], k_center[layer]) for layer in range(num_layers)]
        kept = [[torch.stack((rotations[layer].keys(rows[0], None), rows[1])) for layer, rows in enumerate(kv)]
                for kv in kept]
    else:
        kept = [[torch.stack((rows[0] - k_center[layer], rows[1])) for layer, rows in enumerate(kv)] for kv in kept]
    sums = torch.zeros(num_layers, 2, 4)
    for kv in kept:
        for layer, rows in enumerate(kv):
            for which in range(2):
                sums[layer, which] += run_thresholds(rows[which], outer_ratio, inner_ratio)
    layers = sums / len(prompts)
    counts = torch.cat([outliers_per_vector(kv[layer][which], layers[layer, which])
                        for kv in kept for layer in range(num_layers) for which in range(2)])
    capacity = sparse_capacity if sparse_capacity is not None else choose_capacity(counts, capacity_quantile, head_dim)
    return KVThresholds(
        model=em.identity, layers=layers, k_center=k_center, rotation_signs=signs, k_scale=k_scale,
        rotation_exponent=scale_exponent if key_rotation else 0.0, outer_ratio=outer_ratio, inner_ratio=inner_ratio,
        sparse_capacity=capacity, num_prompts=len(prompts), calibration_text=source,
        overflow_rate=overflow_rate(counts, capacity),
        extra={"prompt_len": prompt_len, "capacity_quantile": capacity_quantile,
               "mean_outliers_per_vector": float(counts.float().mean())},
    )
