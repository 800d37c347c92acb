// LoopSchedule (cpu_schedule.h): pointwise loops, row and column reductions, split
// column reductions; row programs through RowProgramEmitter.
#include "codegen/cpu/cpu_schedule.h"

#include "codegen/cpu/cpu_emitter.h"
#include "codegen/cpu/cpu_rows.h"
#include "ir/ops/nn.h"

namespace kiln::codegen::cpu {

namespace {

constexpr int64_t kTile = 256;  // column-mode accumulator tile (elements)

}  // namespace

LoopSchedule::LoopSchedule(KernelEmitter& e) : e_(e), C_(e.context()), B_(e.builder()), k_(e.kernel()) {}

void LoopSchedule::emit(CpuKernel& ck) {
  const int n = static_cast<int>(k_.domain.size());
  std::vector<int> kept, red;
  for (int d = 0; d < n; ++d) (k_.has_reduction() && k_.reduced[d] ? red : kept).push_back(d);
  std::vector<llvm::Value*> idx(n, nullptr);
  if (!k_.has_reduction()) {
    if (n == 0) {
      e_.guard_once([&] { store_point(idx); });
    } else {
      ck.parallel_dim = 0;
      ck.parallel_extent = k_.domain[0];
      pointwise_loops(0, idx);
    }
  } else {
    if (!kept.empty()) {
      ck.parallel_dim = kept[0];
      ck.parallel_extent = k_.domain[kept[0]];
    }
    // Row programs loop row by row whatever the layout (fast when the reduced dims are
    // innermost, which the fusion pass arranges).
    const bool column = !kept.empty() && kept.back() == n - 1 && !k_.is_row_program();
    auto body = [&] {
      if (column)
        column_tiles(kept, red, idx);
      else
        kept_loops(kept, 0, red, idx, false);  // kept empty: one row
    };
    const int64_t parts = column ? k_.column_split_parts() : 0;
    Extent split_rows = 1;
    int64_t split_cols = 0;
    // A symbolic row count: split at launch when ir::column_sum_partitions splits a
    // static one of these columns at some row count.
    const bool symbolic_split = column && parts == 0 && k_.column_split_shape(&split_rows, &split_cols) &&
                                !split_rows.is_constant() && ir::column_sum_partitions(1 << 20, split_cols) > 0;
    if (parts > 0 || symbolic_split)
      split_column(kept, red, idx, parts, ck);
    else if (kept.empty())
      e_.guard_once(body);
    else if (column && kept.size() == 1)
      column_tiles(kept, red, idx);
    else
      kept_loops(kept, 0, red, idx, column);
  }
}

void LoopSchedule::store_point(const std::vector<llvm::Value*>& idx) {
  std::vector<llvm::Value*> v = e_.eval(idx);
  for (const KStore& s : k_.stores) e_.store(s.param, idx, v[s.expr], /*rounded=*/true);
}

void LoopSchedule::pointwise_loops(int d, std::vector<llvm::Value*>& idx) {
  const int n = static_cast<int>(k_.domain.size());
  if (d == n) {
    store_point(idx);
    return;
  }
  // The two innermost dims as one loop when the innermost is shorter than a vector
  // (a per-channel broadcast over 2x2 or 1x1 feature maps keeps the channel dim apart
  // from the spatial ones): j over both, idx = (j / E, j % E) with E constant (shifts for
  // powers of two), so the loop vectorizer sees one long loop, the broadcast operand a
  // gather, instead of a scalar loop of E iterations per channel.
  constexpr int64_t kShortInner = 8;
  const int64_t inner_e = n >= 2 ? static_extent(k_.domain[n - 1]) : -1;
  const int64_t outer_e = n >= 2 ? static_extent(k_.domain[n - 2]) : -1;
  if (d == n - 2 && d > 0 && inner_e > 1 && inner_e < kShortInner && outer_e >= 0 &&
      outer_e * inner_e >= 2 * kShortInner) {
    llvm::Value* inner = e_.i64c(inner_e);
    e_.for_range(e_.i64c(0), e_.i64c(outer_e * inner_e), [&](llvm::Value* j) {
      idx[n - 2] = B_.CreateUDiv(j, inner);
      idx[n - 1] = B_.CreateURem(j, inner);
      e_.set_flat(n - 2, j, inner_e);
      store_point(idx);
      e_.set_flat(-1, nullptr, 1);
    });
    idx[n - 2] = idx[n - 1] = nullptr;
    return;
  }
  e_.for_range(e_.range_lo(d, 0), e_.range_hi(d, 0), [&](llvm::Value* i) {
    idx[d] = i;
    pointwise_loops(d + 1, idx);
  });
  idx[d] = nullptr;
}

/// Loops over kept dims kept[ki..] (all but the innermost in column mode), then the body.
void LoopSchedule::kept_loops(const std::vector<int>& kept, size_t ki, const std::vector<int>& red,
                              std::vector<llvm::Value*>& idx, bool column) {
  const size_t stop = column ? kept.size() - 1 : kept.size();
  if (ki == stop) {
    if (column)
      column_tiles(kept, red, idx);
    else if (k_.is_row_program())
      RowProgramEmitter(e_, *this).emit(red, idx);
    else
      row_body(red, idx);
    return;
  }
  const int d = kept[ki];
  e_.for_range(e_.range_lo(d, kept[0]), e_.range_hi(d, kept[0]), [&](llvm::Value* i) {
    idx[d] = i;
    kept_loops(kept, ki + 1, red, idx, column);
  });
  idx[d] = nullptr;
}

void LoopSchedule::reduced_loops(const std::vector<int>& red, size_t ri, std::vector<llvm::Value*>& idx,
                                 const std::function<void()>& body, int vector_width, Trip trip) {
  if (ri == red.size()) {
    body();
    return;
  }
  const int d = red[ri];
  const bool inner = ri + 1 == red.size();
  llvm::Value* count = e_.ext(k_.domain[d]);
  if (inner && trip == Trip::whole_vectors && vector_width > 1)
    count = B_.CreateNUWMul(B_.CreateUDiv(count, i64c(vector_width)), i64c(vector_width));
  e_.for_range(
      i64c(0), count,
      [&](llvm::Value* i) {
        idx[d] = i;
        reduced_loops(red, ri + 1, idx, body, vector_width, trip);
      },
      inner ? vector_width : 0, inner && trip == Trip::short_row);
  idx[d] = nullptr;
}

/// The reduced points of flat (row-major over red) indices [lo, hi), in order: one
/// loop whose index is split into the reduced dims' indices.
void LoopSchedule::flat_reduced_loop(const std::vector<int>& red, std::vector<llvm::Value*>& idx, llvm::Value* lo,
                                     llvm::Value* hi, const std::function<void()>& body) {
  e_.for_range(lo, hi, [&](llvm::Value* r) {
    for (size_t k = red.size(); k-- > 0;) {
      const int d = red[k];
      if (k == 0) {
        idx[d] = r;
      } else {
        idx[d] = B_.CreateSRem(r, e_.ext(k_.domain[d]));
        r = B_.CreateSDiv(r, e_.ext(k_.domain[d]));
      }
    }
    body();
  });
  for (int d : red) idx[d] = nullptr;
}

/// Row mode: one register accumulator per store over all reduced dims.
void LoopSchedule::row_body(const std::vector<int>& red, std::vector<llvm::Value*>& idx) {
  std::vector<llvm::Value*> acc;
  for (const KStore& s : k_.stores) {
    llvm::Type* t = e_.acc_type(s);
    acc.push_back(e_.entry_alloca(t, nullptr));
    B_.CreateStore(e_.reduce_init(s), acc.back());
  }
  reduced_loops(red, 0, idx, [&] {
    std::vector<llvm::Value*> v = e_.eval(idx);
    for (size_t s = 0; s < k_.stores.size(); ++s) {
      llvm::Type* t = e_.acc_type(k_.stores[s]);
      // Row sums may reassociate (so they vectorize): an f32-family sum accumulates in
      // double, whose rounding error is far below the final f32 rounding, so the
      // stored result equals the eager sequential double sum except at rare ties.
      const bool reassoc = true;
      B_.CreateStore(e_.reduce_step(k_.stores[s], B_.CreateLoad(t, acc[s]), v[k_.stores[s].expr], reassoc), acc[s]);
    }
  });
  for (size_t s = 0; s < k_.stores.size(); ++s) {
    llvm::Type* t = e_.acc_type(k_.stores[s]);
    e_.store(k_.stores[s].param, idx, e_.acc_result(k_.stores[s], B_.CreateLoad(t, acc[s])));
  }
}

/// Split column reduction (Kernel::column_split_parts = K > 0). Split by columns, a
/// column reduction over few columns gives every thread a part of each row, and both
/// threads' hardware prefetchers then stream about the whole matrix (Codegen/ColSum
/// ran at 0.45-0.6 of copy bandwidth). Here fn(b, begin, end) with end <= K sums the
/// row partitions [begin, end) of the flat reduced index (ir::column_sum_partitions:
/// contiguous rows, from the shape alone) into the scratch buffer (buffers[params],
/// CpuKernel::scratch_bytes: per store, K rows of the flat kept extent in the
/// accumulator type; kept dims that did not merge loop around the column tiles);
/// fn(b, K, K + 1) then folds each column's K partial results in partition order (the
/// same reduce step) and stores them: the eager ReduceSum's and the reference's order.
/// `parts` 0: the row count is symbolic, and K is the launch value the executor passes
/// (CpuKernel::split_parts -1, launch_split_parts), the scratch sized for the most
/// partitions.
void LoopSchedule::split_column(const std::vector<int>& kept, const std::vector<int>& red,
                                std::vector<llvm::Value*>& idx, int64_t parts, CpuKernel& ck) {
  const int inner = kept.back();
  Extent rows_e = 1;
  int64_t cols = 1;
  for (int d : red) rows_e = rows_e * k_.domain[d];
  for (int d : kept) cols *= static_extent(k_.domain[d]);  // static (column_split_shape)
  llvm::Value* rows = e_.ext(rows_e);
  llvm::Value* nparts = parts > 0 ? i64c(parts) : e_.launch_value();
  llvm::Value* scratch = e_.scratch();
  const int64_t max_parts = parts > 0 ? parts : ir::kMaxColumnSumPartitions;
  std::vector<llvm::Type*> ty;
  std::vector<llvm::Value*> base;  // per store: its K x cols partial rows, 8-byte aligned
  int64_t bytes = 0;
  for (const KStore& s : k_.stores) {
    ty.push_back(e_.acc_type(s));
    base.push_back(B_.CreateConstInBoundsGEP1_64(B_.getInt8Ty(), scratch, static_cast<uint64_t>(bytes)));
    const int64_t width = (static_cast<int64_t>(ty.back()->getPrimitiveSizeInBits()) + 7) / 8;  // i1: 1 byte
    bytes += (max_parts * cols * width + 7) / 8 * 8;
  }
  ck.parallel_dim = red[0];
  ck.parallel_extent = parts > 0 ? Extent(parts) : Extent(ir::kMaxColumnSumPartitions);
  ck.split_parts = parts > 0 ? parts : -1;
  if (parts == 0) {
    ck.split_rows = rows_e;
    ck.split_cols = cols;
  }
  ck.scratch_bytes = bytes;
  // The flat (row-major) index of the kept point in idx.
  auto flat_kept = [&] {
    llvm::Value* f = i64c(0);
    for (int d : kept) f = B_.CreateNSWAdd(B_.CreateNSWMul(f, e_.ext(k_.domain[d])), idx[d]);
    return f;
  };
  // Loops over the kept dims but the innermost, then body.
  std::function<void(size_t, const std::function<void()>&)> outer_kept = [&](size_t ki,
                                                                             const std::function<void()>& body) {
    if (ki + 1 >= kept.size()) {
      body();
      return;
    }
    e_.for_range(i64c(0), e_.ext(k_.domain[kept[ki]]), [&](llvm::Value* i) {
      idx[kept[ki]] = i;
      outer_kept(ki + 1, body);
    });
    idx[kept[ki]] = nullptr;
  };
  llvm::BasicBlock* partial = llvm::BasicBlock::Create(C_, "split.partial", e_.function());
  llvm::BasicBlock* combine = llvm::BasicBlock::Create(C_, "split.combine", e_.function());
  llvm::BasicBlock* done = llvm::BasicBlock::Create(C_, "split.end");
  B_.CreateCondBr(B_.CreateICmpSGE(e_.begin(), nparts), combine, partial);
  B_.SetInsertPoint(partial);
  e_.for_range(e_.begin(), e_.end(), [&](llvm::Value* p) {
    llvm::Value* lo = B_.CreateSDiv(B_.CreateNSWMul(p, rows), nparts);
    llvm::Value* hi = B_.CreateSDiv(B_.CreateNSWMul(B_.CreateNSWAdd(p, i64c(1)), rows), nparts);
    llvm::Value* row0 = B_.CreateNSWMul(p, i64c(cols));
    outer_kept(0, [&] {
      column_tile_loops(inner, red, idx, i64c(0), e_.ext(k_.domain[inner]), {lo, hi}, [&](size_t s, llvm::Value* acc) {
        B_.CreateStore(acc, B_.CreateInBoundsGEP(ty[s], base[s], B_.CreateNSWAdd(row0, flat_kept())));
      });
      idx[inner] = nullptr;
    });
  });
  B_.CreateBr(done);
  B_.SetInsertPoint(combine);
  outer_kept(0, [&] {
    e_.for_range(i64c(0), e_.ext(k_.domain[inner]), [&](llvm::Value* j) {
      idx[inner] = j;
      llvm::Value* col = flat_kept();
      for (size_t s = 0; s < k_.stores.size(); ++s) {
        llvm::Value* acc = e_.entry_alloca(ty[s], nullptr);
        B_.CreateStore(B_.CreateLoad(ty[s], B_.CreateInBoundsGEP(ty[s], base[s], col)), acc);
        e_.for_range(i64c(1), nparts, [&](llvm::Value* q) {
          llvm::Value* x = B_.CreateLoad(
              ty[s], B_.CreateInBoundsGEP(ty[s], base[s], B_.CreateNSWAdd(B_.CreateNSWMul(q, i64c(cols)), col)));
          B_.CreateStore(e_.reduce_step(k_.stores[s], B_.CreateLoad(ty[s], acc), x, false), acc);
        });
        e_.store(k_.stores[s].param, idx, e_.acc_result(k_.stores[s], B_.CreateLoad(ty[s], acc)));
      }
    });
    idx[inner] = nullptr;
  });
  B_.CreateBr(done);
  done->insertInto(e_.function());
  B_.SetInsertPoint(done);
}

/// Column mode: the innermost (kept) dim in tiles of kTile accumulators on the stack.
void LoopSchedule::column_tiles(const std::vector<int>& kept, const std::vector<int>& red,
                                std::vector<llvm::Value*>& idx) {
  const int inner = kept.back();
  column_tile_loops(
      inner, red, idx, e_.range_lo(inner, kept[0]), e_.range_hi(inner, kept[0]), {nullptr, nullptr},
      [&](size_t s, llvm::Value* acc) { e_.store(k_.stores[s].param, idx, e_.acc_result(k_.stores[s], acc)); });
}

/// Columns [lo, hi) of the innermost dim `inner` in tiles of kTile stack accumulators,
/// the reduced dims outside the tile loop (only the flat reduced indices [rows.first,
/// rows.second) when given: a row partition of a split reduction); each
/// finished accumulator goes to finish(store, value) with idx[inner] at its column.
void LoopSchedule::column_tile_loops(int inner, const std::vector<int>& red, std::vector<llvm::Value*>& idx,
                                     llvm::Value* lo, llvm::Value* hi, std::pair<llvm::Value*, llvm::Value*> rows,
                                     const std::function<void(size_t, llvm::Value*)>& finish) {
  std::vector<llvm::Value*> acc;
  std::vector<llvm::Type*> ty;
  for (const KStore& s : k_.stores) {
    ty.push_back(e_.acc_type(s));
    acc.push_back(e_.entry_alloca(ty.back(), i64c(kTile)));
  }
  llvm::Value* n = B_.CreateSub(hi, lo);
  llvm::Value* ntiles = B_.CreateSDiv(B_.CreateAdd(n, i64c(kTile - 1)), i64c(kTile));
  e_.for_range(i64c(0), ntiles, [&](llvm::Value* t) {
    llvm::Value* t0 = B_.CreateNSWAdd(lo, B_.CreateNSWMul(t, i64c(kTile)));
    llvm::Value* rem = B_.CreateSub(hi, t0);
    llvm::Value* w = B_.CreateSelect(B_.CreateICmpSLT(rem, i64c(kTile)), rem, i64c(kTile));
    e_.for_range(i64c(0), w, [&](llvm::Value* j) {
      for (size_t s = 0; s < acc.size(); ++s)
        B_.CreateStore(e_.reduce_init(k_.stores[s]), B_.CreateInBoundsGEP(ty[s], acc[s], j));
    });
    auto reduce_body = [&] {
      e_.for_range(i64c(0), w, [&](llvm::Value* j) {
        idx[inner] = B_.CreateNSWAdd(t0, j);
        std::vector<llvm::Value*> v = e_.eval(idx);
        for (size_t s = 0; s < acc.size(); ++s) {
          llvm::Value* slot = B_.CreateInBoundsGEP(ty[s], acc[s], j);
          B_.CreateStore(e_.reduce_step(k_.stores[s], B_.CreateLoad(ty[s], slot), v[k_.stores[s].expr], false), slot);
        }
      });
    };
    if (rows.first)
      flat_reduced_loop(red, idx, rows.first, rows.second, reduce_body);
    else
      reduced_loops(red, 0, idx, reduce_body);
    e_.for_range(i64c(0), w, [&](llvm::Value* j) {
      idx[inner] = B_.CreateNSWAdd(t0, j);
      for (size_t s = 0; s < acc.size(); ++s) finish(s, B_.CreateLoad(ty[s], B_.CreateInBoundsGEP(ty[s], acc[s], j)));
    });
    idx[inner] = nullptr;
  });
}

}  // namespace kiln::codegen::cpu
