"""kvmosaic: an LLM inference engine built around the paged KV cache."""
