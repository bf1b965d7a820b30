"""LLaMA-family decoder (also Qwen2: the same graph with q/k/v biases).

Weights arrive as an HF-named state dict; q/k/v and gate/up projections are
fused at construction so each layer runs two matmuls fewer per step. Each product's weight is asked
of a ``PackedWeights`` store by module name, so a store that already holds it (the repack-once
cache) is never asked to unpack or fuse anything.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn

from kvmosaic.attention.backend import AttentionBackend
from kvmosaic.attention.metadata import AttentionMetadata
from kvmosaic.attention.rotary import RotaryEmbedding
from kvmosaic.config import ModelConfig
from kvmosaic.model.layers.embedding import TokenEmbedding
from kvmosaic.model.layers.linear import gated, make_linear
from kvmosaic.model.layers.linear_methods import (
    PackedFloat,
    PackedWeights,
    Placement,
    Unpacked,
    fuse_gate_up,
    fuse_rows,
)
from kvmosaic.model.layers.norm import RMSNorm
from kvmosaic.ops import Kernels
from kvmosaic.ops.memory import WeightArena


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: Mapping[str, torch.Tensor], index: int, kernels: Kernels,
                 place: Placement, packed: PackedWeights) -> None:
        """``place`` stores the tensors a step streams (the model's weight arena); ``packed`` gives
        each product's weight in its kernels' layout."""
        super().__init__()
        prefix = f"model.layers.{index}."
        att = prefix + "self_attn."
        self.index = index
        input_norm = w[prefix + "input_layernorm.weight"]
        dtype = input_norm.dtype  # the model's float dtype
        qkv_weight = packed(att + "qkv_proj", lambda: fuse_rows([w[att + f"{p}_proj.weight"] for p in "qkv"], dtype))
        qkv_bias = None
        if att + "q_proj.bias" in w:
            qkv_bias = torch.cat([w[att + f"{p}_proj.bias"] for p in "qkv"])
        # made in the order a step reads them, so they follow each other in the arena
        self.qkv_proj = make_linear(qkv_weight, qkv_bias, kernels, place)
        self.o_proj = make_linear(packed(att + "o_proj", lambda: w[att + "o_proj.weight"]), kernels=kernels,
                                  place=place)
        mlp = prefix + "mlp."
        gate_up = packed(mlp + "gate_up_proj", lambda: fuse_gate_up(w[mlp + "gate_proj.weight"],
                                                                    w[mlp + "up_proj.weight"], dtype))
        self.gate_up_proj = gated(gate_up, kernels, place)
        self.down_proj = make_linear(packed(mlp + "down_proj", lambda: w[mlp + "down_proj.weight"]), kernels=kernels,
                                     place=place)
        self.input_layernorm = RMSNorm(input_norm, cfg.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(w[prefix + "post_attention_layernorm.weight"], cfg.rms_norm_eps,
                                                kernels)
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        # bound forwards in the instance dict: reading a submodule goes through nn.Module.__getattr__,
        # eight times per layer and token, a visible share of single-stream decode
        self._steps = (self.input_layernorm.forward, self.qkv_proj.forward, self.o_proj.forward,
                       self.post_attention_layernorm.forward, self.gate_up_proj.forward, self.down_proj.forward)

    def packed_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """This layer's weights in the order ``ops.layer_stack`` takes them (a linear as weight,
        scales, mins) and a composite qkv's parts (else []), or None when one of its products does not
        run inside it (the stack takes a composite qkv only)."""
        stacks = [lin.method.stack_weights() for lin in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)]
        unfused = isinstance(self.gate_up_proj.method, PackedFloat) and not self.gate_up_proj.method.fuses_swiglu
        if unfused or any(s is None for s in stacks) or any(len(s) != 3 for s in stacks[1:]):
            return None  # layer_stack takes float gate/up with SwiGLU fused
        qkv, o, gate_up, down = stacks
        qkv_parts = list(qkv) if len(qkv) > 3 else []
        if qkv_parts:
            qkv = (torch.empty(0),) * 3  # the stack reads the parts instead
        qkv_bias = self.qkv_proj.method.bias
        return [self.input_layernorm.weight.data, *qkv, torch.empty(0) if qkv_bias is None else qkv_bias, *o,
                self.post_attention_layernorm.weight.data, *gate_up, *down], qkv_parts

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None, rotary: RotaryEmbedding,
                attention: AttentionBackend, meta: AttentionMetadata,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual`` is the running hidden state (updated in place with ``delta``, the previous
        layer's output); returns (residual, this layer's MLP output, to be added by the next norm).

        ``keep_rows`` (the last layer): only these rows go on past attention; the others' K/V are
        cached and nothing reads their output, so their share of o_proj and the MLP is skipped."""
        # submodules' forward() is called directly: nn.Module.__call__ costs microseconds per call,
        # which adds up to a visible share of a single-stream decode step over 30 layers
        input_norm, qkv_proj, o_proj, post_norm, gate_up_proj, down_proj = self._steps
        n = residual.shape[0]
        qkv = qkv_proj(input_norm(residual, delta))
        attn = attention.forward(self.index, qkv, rotary, meta).view(n, self.q_size)
        if keep_rows is not None:
            attn, residual = attn[keep_rows], residual[keep_rows]
        hidden = post_norm(residual, o_proj(attn))
        return residual, down_proj(gate_up_proj(hidden))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], kernels: Kernels,
                 max_positions: int | None = None, packed: PackedWeights | None = None) -> None:
        """``packed``: where each product's weight in its kernels' layout comes from (default: built
        from ``weights`` now); the caller finishes it (``packed.finish()``) once the model is built."""
        super().__init__()
        self.config = cfg
        packed = packed if packed is not None else Unpacked(kernels)
        place = packed.placement(WeightArena().place)
        self.layers = nn.ModuleList(DecoderLayer(cfg, weights, i, kernels, place, packed)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(weights["model.norm.weight"], cfg.rms_norm_eps, kernels)
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.lm_head = make_linear(packed("lm_head", lambda: weights[head_name]), kernels=kernels, place=place)
        # a tied table the head holds quantized is read through the head's weight (no second copy)
        tied = cfg.tie_word_embeddings and hasattr(self.lm_head.method, "rows")
        table = self.lm_head.method if tied else weights["model.embed_tokens.weight"]
        self.embed_tokens = TokenEmbedding(table, self.norm.weight.dtype)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        # A step can run all layers in one kernel call when every product is packed, and the final
        # norm and LM head with them when the head is packed too; the kernels check and plan the
        # weights once here.
        self._stack_ops = kernels.ops
        self._packed_weights = self._stack_weights(kernels.ops)

    def _stack_weights(self, ops) -> object | None:
        per_layer = [layer.packed_weights() for layer in self.layers]
        if ops is None or any(w is None for w in per_layer):
            return None
        head = self.lm_head.method.stack_weights()
        qkv_parts = [parts for _, parts in per_layer]
        return ops.StackWeights([t for w, _ in per_layer for t in w],
                                [] if head is None or len(head) != 3 else [self.norm.weight.data, *head],
                                qkv_parts if any(qkv_parts) else [])

    def first_layers(self, count: int) -> LlamaForCausalLM:
        """This model cut to its first ``count`` layers, sharing every weight. A forward's activation
        memory does not grow with depth, so the KV-sizing profile runs this at a fraction of the cost."""
        cut = copy.copy(self)
        cut._modules = dict(self._modules)  # a shallow copy would share (and so change) the module table
        cut._modules["layers"] = nn.ModuleList(list(self.layers)[:count])
        if self._packed_weights is not None:
            cut._packed_weights = cut._stack_weights(self._stack_ops)
        return cut

    def _run_layer_stack(self, residual: torch.Tensor, attention: AttentionBackend, meta: AttentionMetadata,
                         keep_rows: torch.Tensor | None) -> list[torch.Tensor] | None:
        """All layers of the step in one call (bit-identical to the layer loop), or None when the
        weights or this step's attention need the per-layer path: [the kept rows' float32 logits]
        when the stack runs the head too, else (residual, delta) for the final norm."""
        if self._packed_weights is None:
            return None
        stack = attention.layer_stack()
        if stack is None:
            return None
        return stack(residual, self._packed_weights, self.rotary, meta, self.config.rms_norm_eps, keep_rows)

    def decode_passes(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend,
                      block_tables: torch.Tensor, passes: int, stop_ids: list[int]) -> torch.Tensor | None:
        """Up to ``passes`` greedy passes of decode rows (one token per sequence, at ``positions``,
        block tables holding every slot the passes use) in one kernel call, each row's argmax fed back
        as its next input: [passes run, rows] tokens, ending early after a pass that sampled any of
        ``stop_ids``. None when the weights, the backend or the embedding need Python between passes."""
        run = attention.decode_passes() if self._packed_weights is not None else None
        table = self.embed_tokens.kernel_table()
        if run is None or table is None or self.lm_head.method.stack_weights() is None:
            return None
        return run(input_ids, self.embed_tokens.dtype, self._packed_weights, self.rotary, positions, block_tables,
                   table, stop_ids, passes, self.config.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend,
                meta: AttentionMetadata, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Packed tokens in, logits out for ``logits_indices`` rows (all rows when None).

        ``attention`` is the step's attention backend: it owns the KV cache every layer writes and reads.
        """
        residual = self.embed_tokens(input_ids)
        meta.positions = positions
        stacked = self._run_layer_stack(residual, attention, meta, logits_indices)
        if stacked is not None:
            return stacked[0] if len(stacked) == 1 else self.lm_head(self.norm(*stacked)).float()
        delta = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            keep = logits_indices if i == last else None
            residual, delta = layer.forward(residual, delta, self.rotary, attention, meta, keep)
        return self.lm_head(self.norm(residual, delta)).float()
