// Argument checks in kernel files, without the PyTorch headers: KV_CHECK(cond, parts...) throws
// std::runtime_error with the parts streamed together, which the binding layer (pybind11) raises in
// Python as RuntimeError, as TORCH_CHECK's error is.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace kvops {

template <typename... Parts>
[[noreturn]] void check_failed(const char* condition, const Parts&... parts) {
  std::ostringstream message;
  if constexpr (sizeof...(Parts) == 0) {
    message << "check failed: " << condition;
  } else {
    (message << ... << parts);
  }
  throw std::runtime_error(message.str());
}

}  // namespace kvops

#define KV_CHECK(cond, ...)                                          \
  do {                                                               \
    if (__builtin_expect(!(cond), 0)) {                              \
      ::kvops::check_failed(#cond __VA_OPT__(, ) __VA_ARGS__);      \
    }                                                                \
  } while (0)
