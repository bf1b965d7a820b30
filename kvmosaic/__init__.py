"""kvmosaic: an LLM inference engine built around the paged KV cache."""

from __future__ import annotations

import importlib

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

# Lazy so that `import kvmosaic.core...` stays light (no torch/model imports).
_EXPORTS = {
    "LLM": "kvmosaic.entrypoints.llm",
    "EngineArgs": "kvmosaic.engine_args",
    "SamplingParams": "kvmosaic.sampling_params",
    "RequestOutput": "kvmosaic.outputs",
    "CompletionOutput": "kvmosaic.outputs",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvmosaic' has no attribute {name!r}")
