#include "runtime/arena.h"

#include <cstring>

namespace kiln::runtime {

StepArena::StepArena(std::unordered_map<const ir::Value*, ArenaSlot> slots, int64_t block_bytes)
    : block_bytes_(block_bytes) {
  block_ = std::make_shared<ir::Storage>(static_cast<size_t>(std::max<int64_t>(block_bytes, 1)), /*zero=*/false);
  char* base = static_cast<char*>(block_->data());
  for (auto& [v, s] : slots) {
    Entry e;
    e.slot = s;
    if (s.home && s.offset >= 0 && s.offset + s.bytes <= block_bytes) {
      // held_refs 1: this map's own reference does not make a tensor's storage shared.
      e.storage = std::make_shared<ir::Storage>(base + s.offset, static_cast<size_t>(s.bytes), block_, 1);
      ++homes_;
    } else {
      e.slot.home = false;
    }
    slots_.emplace(v, std::move(e));
  }
}

ir::Tensor StepArena::output(const ir::Value* v, ir::DType dtype, const std::vector<int64_t>& dims, bool zero) const {
  auto it = slots_.find(v);
  if (it == slots_.end() || !it->second.storage) return {};
  const int64_t bytes = ir::numel_of(dims) * static_cast<int64_t>(ir::dtype_size(dtype));
  if (bytes > it->second.slot.bytes) return {};
  if (zero && bytes > 0) std::memset(it->second.storage->data(), 0, static_cast<size_t>(bytes));
  placed_.fetch_add(1, std::memory_order_relaxed);
  return ir::Tensor::over(it->second.storage, dtype, dims);
}

bool StepArena::contains(const void* p) const {
  const char* b = static_cast<const char*>(block_->data());
  const char* c = static_cast<const char*>(p);
  return p && c >= b && c < b + block_bytes_;
}

bool StepArena::at_planned_place(const ir::Value* v, const void* p) const {
  auto it = slots_.find(v);
  return it != slots_.end() && static_cast<const char*>(block_->data()) + it->second.slot.offset == p;
}

std::vector<std::pair<const ir::Value*, ArenaSlot>> StepArena::slots() const {
  std::vector<std::pair<const ir::Value*, ArenaSlot>> r;
  r.reserve(slots_.size());
  for (const auto& [v, e] : slots_) r.emplace_back(v, e.slot);
  return r;
}

namespace {
void collect_slots(const ir::Graph& g, std::unordered_map<const ir::Value*, ArenaSlot>& slots) {
  for (const ir::Value* in : g.inputs)  // a loop body's inputs may be planned too
    if (in->arena.placed()) slots.emplace(in, ArenaSlot{in->arena.offset, in->arena.bytes, in->arena.home});
  for (const auto& n : g.nodes()) {
    for (const ir::Value* o : n->outputs)
      if (o->arena.placed()) slots.emplace(o, ArenaSlot{o->arena.offset, o->arena.bytes, o->arena.home});
    for (const auto& r : n->regions) collect_slots(*r, slots);
  }
}
}  // namespace

std::shared_ptr<StepArena> StepArena::of_graph(const ir::Graph& g) {
  if (g.arena_bytes < 0) return nullptr;
  std::unordered_map<const ir::Value*, ArenaSlot> slots;
  collect_slots(g, slots);
  return std::make_shared<StepArena>(std::move(slots), g.arena_bytes);
}

}  // namespace kiln::runtime
