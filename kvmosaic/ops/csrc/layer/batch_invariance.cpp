#include "common/batch_invariance.h"

#include <atomic>

namespace kvops {

namespace {
std::atomic<bool> invariant{true};
}  // namespace

bool batch_invariant() { return invariant.load(std::memory_order_relaxed); }

void set_batch_invariant(bool on) { invariant.store(on, std::memory_order_relaxed); }

}  // namespace kvops
