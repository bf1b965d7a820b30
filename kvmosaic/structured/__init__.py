"""Structured output: grammars (JSON schema, regex, choice, Lark/GBNF) that constrain sampling."""

from kvmosaic.structured.params import GuidedDecoding

__all__ = ["GuidedDecoding"]
