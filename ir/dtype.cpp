#include "ir/dtype.h"

#include <cmath>

namespace kiln::ir {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
    case DType::i64:
      return 8;
    case DType::i32:
      return 4;
    case DType::i8:
      return 1;
    case DType::u8:
      return 1;
    case DType::boolean:
      return 1;
    default:
      return 0;
  }
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i64:
      return "i64";
    case DType::i32:
      return "i32";
    case DType::i8:
      return "i8";
    case DType::u8:
      return "u8";
    case DType::boolean:
      return "bool";
    default:
      return "undefined";
  }
}

Expected<DType> dtype_from_name(const std::string& s) {
  for (int i = 0; i <= static_cast<int>(DType::boolean); ++i) {
    auto t = static_cast<DType>(i);
    if (s == dtype_name(t)) return t;
  }
  return Status::error("unknown dtype '" + s + "'");
}

Expected<DType> dtype_from_onnx(int o) {
  switch (o) {
    case 1:
      return DType::f32;
    case 2:
      return DType::u8;
    case 3:
      return DType::i8;
    case 6:
      return DType::i32;
    case 7:
      return DType::i64;
    case 9:
      return DType::boolean;
    case 10:
      return DType::f16;
    case 11:
      return DType::f64;
    case 16:
      return DType::bf16;
    default:
      return Status::error("unsupported ONNX element type " + std::to_string(o));
  }
}

int dtype_to_onnx(DType t) {
  switch (t) {
    case DType::f32:
      return 1;
    case DType::u8:
      return 2;
    case DType::i8:
      return 3;
    case DType::i32:
      return 6;
    case DType::i64:
      return 7;
    case DType::boolean:
      return 9;
    case DType::f16:
      return 10;
    case DType::f64:
      return 11;
    case DType::bf16:
      return 16;
    default:
      return 0;
  }
}

bool is_float(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16; }
bool is_integer(DType t) { return t == DType::i64 || t == DType::i32 || t == DType::i8 || t == DType::u8; }

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mant = x & 0x007fffffu;
  int exp = static_cast<int>((x >> 23) & 0xff);
  if (exp == 255) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0));
  int e = exp - 127 + 15;
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (e <= 0) {
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x00800000u;
    int shift = 14 - e;
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(half);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t out;
  if (exp == 0) {
    if (mant == 0) {
      out = sign;
    } else {
      float v = std::ldexp(static_cast<float>(mant), -24);
      std::memcpy(&out, &v, 4);
      out |= sign;
    }
  } else if (exp == 31) {
    out = sign | 0x7f800000u | (mant << 13);
  } else {
    out = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &out, 4);
  return f;
}

}  // namespace kiln::ir
