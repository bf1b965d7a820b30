// The 16-bit storage types the kernels read and write, without the PyTorch headers: bf16 and half are
// the same bits as c10::BFloat16 and c10::Half (the binding files cast the tensors' pointers), and
// convert to and from float exactly as those do (round to nearest even; a NaN stays a quiet NaN).
#pragma once

#include <cstdint>
#include <cstring>

namespace kvmosaic_vec {

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

struct bf16 {
  uint16_t x;
  bf16() = default;
  // float -> bf16: round to nearest even; NaN -> 0x7FC0
  bf16(float f) : x(f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>((float_bits(f) + (((float_bits(f) >> 16) & 1u) + 0x7FFFu)) >> 16)) {}  // NOLINT
  operator float() const { return bits_float(static_cast<uint32_t>(x) << 16); }  // NOLINT
};

struct half {
  uint16_t x;
  half() = default;
  half(float f) : x(from_float(f)) {}  // NOLINT
  operator float() const { return to_float(x); }  // NOLINT

  static float to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;
    if (exponent == 0x1Fu) return bits_float(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
    if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    if (mantissa == 0) return bits_float(sign);
    int shift = 0;  // subnormal: normalise
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    return bits_float(sign | ((113u - shift) << 23) | ((mantissa & 0x3FFu) << 13));
  }

  static uint16_t from_float(float f) {
    const uint32_t u = float_bits(f);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    const uint32_t magnitude = u & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u) return sign | 0x7E00u;  // NaN
    if (magnitude >= 0x477FF000u) return sign | 0x7C00u;  // rounds past the largest half: inf
    if (magnitude < 0x38800000u) {  // a half subnormal (or zero): round the shifted mantissa to even
      const float scaled = bits_float(magnitude) * 16777216.0f;  // * 2^24: units of the smallest subnormal
      uint32_t q = static_cast<uint32_t>(scaled);
      const float rest = scaled - static_cast<float>(q);
      if (rest > 0.5f || (rest == 0.5f && (q & 1u))) ++q;
      return sign | static_cast<uint16_t>(q);
    }
    const uint32_t rounded = magnitude + 0x0FFFu + ((magnitude >> 13) & 1u) - (112u << 23);
    return sign | static_cast<uint16_t>(rounded >> 13);
  }
};

static_assert(sizeof(bf16) == 2 && sizeof(half) == 2, "16-bit storage types");

}  // namespace kvmosaic_vec
