// Whether the kernels keep each row's arithmetic independent of the rows computed beside it (the
// default): a row then gets the same bits alone, in a decode batch of any size, inside a prefill chunk
// of any split, and whatever the thread count, so a greedy request's tokens do not depend on the
// company it keeps. Off, the kernels may take paths whose arithmetic depends on the row count and
// that are faster there: the AMX tiles from amx::kMinRows rows (bf16 products) and the register-tiled
// prefill attention. One switch per process, set by the engine at start (EngineConfig.deterministic).
#pragma once

namespace kvops {

bool batch_invariant();
void set_batch_invariant(bool on);

}  // namespace kvops
