// encode_cpu_schedule / decode_cpu_schedule (codegen/cpu/llvm_cpu.h): a CPU kernel's
// schedule as bytes, for the compile cache and the program file. In kiln_codegen, not
// kiln_codegen_cpu, because `kiln compile`'s training binary (no LLVM) reads it too.
#include <algorithm>

#include "codegen/cpu/llvm_cpu.h"
#include "ir/ops/nn.h"
#include "ir/serialize.h"

namespace kiln::codegen {

int64_t launch_split_parts(const CpuKernel& k, int64_t rows) {
  if (k.split_parts >= 0) return k.split_parts;
  return std::max<int64_t>(1, ir::column_sum_partitions(rows, k.split_cols));
}

std::string encode_cpu_schedule(const CpuKernel& k) {
  ir::ByteWriter w;
  w.str(k.name);
  w.i64(k.parallel_dim);
  w.str(k.parallel_extent.to_string());
  w.str(k.work_per_index.to_string());
  w.i64(k.split_parts);
  w.str(k.split_rows.to_string());
  w.i64(k.split_cols);
  w.i64(k.scratch_bytes);
  w.u64(k.symbols.size());
  for (const std::string& s : k.symbols) w.str(s);
  return std::move(w.data());
}

bool decode_cpu_schedule(const std::string& bytes, CpuKernel& k) {
  ir::ByteReader r(bytes);
  int64_t dim;
  std::string extent, work, split_rows;
  uint64_t n;
  if (!r.str(k.name) || !r.i64(dim) || !r.str(extent) || !r.str(work) || !r.i64(k.split_parts) || !r.str(split_rows) ||
      !r.i64(k.split_cols) || !r.i64(k.scratch_bytes) || !r.count(n, 8))
    return false;
  for (uint64_t i = 0; i < n; ++i) {
    std::string s;
    if (!r.str(s)) return false;
    k.symbols.push_back(std::move(s));
  }
  auto e = ir::SymExpr::parse(extent);
  auto wk = ir::SymExpr::parse(work);
  auto sr = ir::SymExpr::parse(split_rows);
  if (!e || !wk || !sr || !r.at_end() || dim < -1 || dim > 64 || k.split_parts < -1 || k.split_cols < 0 ||
      k.scratch_bytes < 0)
    return false;
  if (k.split_parts < 0 && (k.symbols.empty() || k.split_cols == 0)) return false;
  k.split_rows = *sr;
  if (e->is_constant() && e->constant_value() < 0) return false;
  k.parallel_dim = static_cast<int>(dim);
  k.parallel_extent = *e;
  k.work_per_index = *wk;
  return true;
}

}  // namespace kiln::codegen
