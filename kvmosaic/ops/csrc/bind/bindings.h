// What the two binding files share.
#pragma once

#include <torch/extension.h>

namespace kvops {
// The long kernels run without the GIL, so another Python thread of the process (the creditor's
// micro-attention server of kvmosaic.distributed, the API server's event loop) goes on meanwhile.
// Arguments are converted before and results after, with the GIL held.
inline const py::call_guard<py::gil_scoped_release> no_gil;
}  // namespace kvops
