// Element types and the bf16 <-> fp32 conversions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace switchyard {

/// Element type of a Tensor.
/// int16 / uint16 hold route ids as rollout engines ship them (verl's int16 routed_experts, vLLM's
/// uint16 arrays for more than 256 experts); no kernel computes on them.
enum class DType : uint8_t { bf16, fp32, fp64, int32, int64, uint8, boolean, int16, uint16 };

/// Bytes per element of `dtype`.
size_t dtype_size(DType dtype);
/// Lower-case name ("bf16", "fp32", ...), as used in error messages.
const char* dtype_name(DType dtype);

/// A bfloat16 value: the upper 16 bits of an IEEE fp32. Storage only; arithmetic goes through fp32.
struct bf16 {
  uint16_t bits = 0;
};

/// bf16 -> fp32 is exact.
inline float bf16_to_float(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// fp32 -> bf16, rounding to nearest with ties to even; NaN stays NaN (quiet, sign kept),
/// overflow rounds to +-Inf as IEEE rounding says.
inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force a quiet payload bit
    return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return bf16{static_cast<uint16_t>(u >> 16)};
}

/// fp64 -> bf16 rounded once to nearest even (no double rounding through fp32): round to odd into
/// fp32 (a sticky bit in the 16 spare bits), then fp32 -> bf16 to nearest even.
inline bf16 double_to_bf16(double v) {
  float f = static_cast<float>(v);
  if (std::isnan(v) || static_cast<double>(f) == v) return float_to_bf16(f);
  if (std::fabs(static_cast<double>(f)) > std::fabs(v)) f = std::nextafter(f, 0.0f);
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u |= 1u;
  std::memcpy(&f, &u, sizeof f);
  return float_to_bf16(f);
}

/// The DType of a C++ element type (bf16, float, double, int32_t, int64_t, uint8_t, bool, int16_t,
/// uint16_t).
template <class T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<bf16>() { return DType::bf16; }
template <> constexpr DType dtype_of<float>() { return DType::fp32; }
template <> constexpr DType dtype_of<double>() { return DType::fp64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::int32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::int64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::uint8; }
template <> constexpr DType dtype_of<bool>() { return DType::boolean; }
template <> constexpr DType dtype_of<int16_t>() { return DType::int16; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::uint16; }

}  // namespace switchyard
