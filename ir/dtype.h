// Element types of kiln tensors, with ONNX TensorProto.DataType mapping.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

#include "ir/status.h"

namespace kiln::ir {

/// Element type of a tensor. `boolean` is stored as one byte (0 or 1).
enum class DType : uint8_t { f32, f64, bf16, f16, i64, i32, i8, u8, boolean, undefined };

/// Size of one element in bytes (0 for undefined).
size_t dtype_size(DType t);
/// Short name used by the text IR: "f32", "bf16", "i64", "bool", ...
const char* dtype_name(DType t);
/// Parses a short name; error for unknown names.
Expected<DType> dtype_from_name(const std::string& s);
/// Maps ONNX TensorProto.DataType (1=FLOAT, 7=INT64, 16=BFLOAT16, ...); error if unsupported.
Expected<DType> dtype_from_onnx(int onnx_type);
/// Maps a kiln dtype to ONNX TensorProto.DataType.
int dtype_to_onnx(DType t);
bool is_float(DType t);    ///< f32, f64, bf16, f16
bool is_integer(DType t);  ///< i64, i32, i8, u8 (bool is neither)

/// bfloat16 <-> float, round to nearest even on store (NaN kept quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
/// IEEE half <-> float, round to nearest even.
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);

}  // namespace kiln::ir
