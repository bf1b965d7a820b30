"""Quantize a float GGUF with llama.cpp's own quantizer (llama-cpp-python's ``llama_model_quantize``).

    python llamacpp_quantize.py IN.gguf OUT.gguf q8_0|q4_0|q4_1|q4_k|q6_k|q4_k_m

Runs in the llamacpp venv. "Pure" files (``llama-quantize --pure``): every 2-D tensor, the token
embeddings included, in the one format, so a row of the oracle measures that format. Where a
tensor's rows do not fit the format llama.cpp falls back on its own: SmolLM2's 576-wide rows are not
a multiple of 256, so a q4_k file holds Q4_K in the 30 ffn_down tensors and Q5_0 elsewhere. q4_k_m
is llama.cpp's own mix (the file most people download), not pure.
"""

from __future__ import annotations

import ctypes
import sys

import llama_cpp

# Pure files: Q4_K_S and Q4_K_M differ only in their mixes, so either names Q4_K.
FTYPES = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
          "q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1, "q4_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S,
          "q6_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}
MIXES = {"q4_k_m"}


def main() -> int:
    source, out, fmt = sys.argv[1:4]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[fmt]
    params.nthread = 2
    params.pure = fmt not in MIXES
    code = llama_cpp.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params))
    if code != 0:
        print(f"llama_model_quantize returned {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
