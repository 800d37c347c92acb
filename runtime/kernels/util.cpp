// Shared kernel helpers (see util.h): broadcast strides and the strided copy.
#include "runtime/kernels/util.h"

namespace kiln::runtime::kernels {

std::vector<int64_t> broadcast_strides(const std::vector<int64_t>& in, const std::vector<int64_t>& out) {
  std::vector<int64_t> s(out.size(), 0);
  std::vector<int64_t> own = ir::strides_of(in);
  int off = static_cast<int>(out.size()) - static_cast<int>(in.size());
  for (int i = 0; i < static_cast<int>(in.size()); ++i)
    if (off + i >= 0) s[off + i] = in[i] == 1 ? 0 : own[i];
  return s;
}

template <typename W>
static void strided_copy_typed(W* dst, const W* src, const std::vector<int64_t>& out_dims,
                               const std::vector<int64_t>& src_strides, int64_t src_offset) {
  const W* s = src + src_offset;
  for_each_strided<1>(out_dims, {src_strides},
                      [&](int64_t o, const std::array<int64_t, 1>& off) { dst[o] = s[off[0]]; });
}

void strided_copy(void* dst, const void* src, size_t esize, const std::vector<int64_t>& out_dims,
                  const std::vector<int64_t>& src_strides, int64_t src_offset) {
  switch (esize) {
    case 1:
      strided_copy_typed(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), out_dims, src_strides,
                         src_offset);
      break;
    case 2:
      strided_copy_typed(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), out_dims, src_strides,
                         src_offset);
      break;
    case 4:
      strided_copy_typed(static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(src), out_dims, src_strides,
                         src_offset);
      break;
    default:
      strided_copy_typed(static_cast<uint64_t*>(dst), static_cast<const uint64_t*>(src), out_dims, src_strides,
                         src_offset);
      break;
  }
}

}  // namespace kiln::runtime::kernels
