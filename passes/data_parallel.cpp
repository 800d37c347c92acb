// data_parallel: makes a training step one rank's share of a data-parallel job (issue
// 35): the gradients are summed over the ranks before anything reads them, as PyTorch's
// DistributedDataParallel does, with the collectives as IR (AllReduceStart/AllReduceWait,
// ReduceScatter; fusion class "collective") so that every decision shows in the dump
// (DESIGN.md invariant 2).
//
// Input: a training step after optimizer and accumulation. Option world_size = N
// (N <= 1: no change). Algorithm:
//  1. The gradients: "<param>.grad" of every parameter binding (after accumulation the
//     loop's outputs carry those names: one all-reduce per gradient per optimizer step,
//     none per microbatch), ordered as backward produces them (position of the producer;
//     for loop outputs, of the accumulator's update in the body).
//  2. Buckets (DDP's Reducer): consecutive gradients of one dtype fill a bucket up to
//     first_bucket_cap_mb MiB for the first (at most bucket_cap_mb) and bucket_cap_mb MiB
//     for the others; a
//     gradient larger than the cap has a bucket of its own. The loss joins the last
//     bucket (one collective fewer), so the logged loss is the job's.
//  3. Per bucket (attribute `bucket`) an AllReduceStart right after the last producer of
//     its members, which hands the bucket to the communication thread, and an
//     AllReduceWait just before the first reader of any member, which returns the sums:
//     the all-reduce runs while the rest of backward computes (DDP's overlap; with an
//     accumulation loop the gradients exist only after it, so the overlap is with the
//     loop's other carried results and the optimizer pieces before the first reader).
//     Every reader of a member (clipping's norm, the optimizer, graph outputs) reads the
//     sum instead. The norm is therefore the global one and every rank takes the same
//     update.
//  4. ZeRO-1 (the optimizer pass with zero_shards > 1 reads each gradient through Shard):
//     gradients that only Shard nodes read form buckets of their own, each a
//     ReduceScatter (attribute shard_elems) whose outputs replace the Shard nodes: each
//     rank receives the sum of its shard only (DeepSpeed's stage 1, ZeRO paper sec. 5.1).
// Normalization: attach_loss divides by the job's counts (a mean loss by accum * N; a
// token-normalized loss by the job's num_items_in_batch, which the trainer sums over the
// ranks), so the sum over the ranks is the loss of one batch of N times the rows.
// BatchNormalization running statistics stay per rank (each rank's own batch), as DDP
// leaves them without SyncBatchNorm.
#include <algorithm>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "passes/passes.h"
#include "passes/training_util.h"

namespace kiln::passes {

using namespace kiln::ir;

namespace {

class DataParallel : public Pass {
 public:
  std::string name() const override { return "data_parallel"; }
  std::string describe_options(const PassOptions& o) const override {
    const DataParallelOptions& d = o.data_parallel;
    return OptionText()
        .add("world_size", d.world_size)
        .add("bucket_cap_mb", d.bucket_cap_mb)
        .add("first_bucket_cap_mb", d.first_bucket_cap_mb)
        .str();
  }
  Expected<bool> run(Graph& g, PassContext& ctx) override {
    const DataParallelOptions& o = ctx.options.data_parallel;
    if (o.world_size <= 1) return false;
    if (o.bucket_cap_mb <= 0 || o.first_bucket_cap_mb <= 0)
      return Status::error("data_parallel: bucket sizes must be > 0 MiB");
    // Position of each top-level node; a loop output's is the loop's, refined by the
    // position of its update in the body.
    std::unordered_map<const Node*, size_t> pos;
    for (size_t i = 0; i < g.nodes().size(); ++i) pos[g.nodes()[i].get()] = i;
    auto order_of = [&](const Value* v) -> std::pair<size_t, size_t> {
      const Node* p = v->producer;
      if (!p) return {0, 0};
      size_t inner = 0;
      if (has_trait(*p, OpTrait::loop) && !p->regions.empty()) {
        const Graph& body = *p->regions[0];
        for (size_t k = 0; k < p->outputs.size(); ++k)
          if (p->outputs[k] == v && k < body.outputs.size() && body.outputs[k]->producer)
            inner = static_cast<size_t>(std::max(0, body.index_of(body.outputs[k]->producer))) + 1;
      }
      return {pos.at(p) + 1, inner};
    };
    struct Member {
      Value* value;
      std::pair<size_t, size_t> order;
    };
    std::vector<Member> grads;
    for (auto& sb : g.state) {
      if (sb.kind != "parameter") continue;
      Value* gr = g.find_value(sb.input->name + ".grad");
      if (!gr) return Status::error("data_parallel: no gradient '" + sb.input->name + ".grad' (run autodiff first)");
      grads.push_back({gr, order_of(gr)});  // ties keep the state order (stable sort)
    }
    if (grads.empty()) return Status::error("data_parallel: no trainable parameters");
    Value* loss = g.find_value("loss");
    if (!loss) return Status::error("data_parallel: no 'loss' value");
    std::stable_sort(grads.begin(), grads.end(), [](const Member& a, const Member& b) { return a.order < b.order; });

    // ZeRO-1 (passes/optimizer.cpp zero_shards): a gradient that only Shard nodes read
    // needs this rank's shard of the sum only: a reduce-scatter instead of an all-reduce.
    std::unordered_map<const Value*, std::vector<Node*>> shard_readers;
    for (const Member& m : grads) {
      std::vector<Node*> readers;
      bool only_shards = true;
      for (const Use& u : g.uses(m.value)) {
        if (has_trait(*u.user, OpTrait::rank_shard))
          readers.push_back(u.user);
        else
          only_shards = false;
      }
      if (only_shards && !readers.empty() && !g.is_graph_output(m.value)) shard_readers[m.value] = readers;
    }

    // ---- buckets: consecutive gradients of one dtype and one kind (summed or sharded) ----
    const double mib = 1024.0 * 1024.0;
    struct Bucket {
      std::vector<Value*> members;
      bool sharded = false;
    };
    std::vector<Bucket> buckets;
    double filled = 0;
    for (const Member& m : grads) {
      const bool sharded = shard_readers.count(m.value) > 0;
      const double bytes = double(m.value->shape.numel()) * double(dtype_size(m.value->dtype));
      const double cap =
          (buckets.size() <= 1 ? std::min(o.first_bucket_cap_mb, o.bucket_cap_mb) : o.bucket_cap_mb) * mib;
      const bool fits = !buckets.empty() && buckets.back().sharded == sharded &&
                        buckets.back().members.front()->dtype == m.value->dtype && filled + bytes <= cap;
      if (!fits) {
        buckets.push_back({{}, sharded});
        filled = 0;
      }
      buckets.back().members.push_back(m.value);
      filled += bytes;
    }
    if (!buckets.back().sharded && buckets.back().members.front()->dtype == loss->dtype)
      buckets.back().members.push_back(loss);
    else
      buckets.push_back({{loss}, false});

    // ---- one collective per bucket, right after its last producer ----
    std::unordered_map<Value*, Value*> summed;        // value -> its sum over the ranks
    std::unordered_map<Value*, Value*> shard_of_sum;  // a Shard node's output -> the reduce-scatter's
    std::unordered_set<const Node*> made;
    for (size_t k = 0; k < buckets.size(); ++k) {
      const Bucket& bk = buckets[k];
      std::vector<std::string> outs;
      for (Value* v : bk.members) outs.push_back(v->name + (bk.sharded ? ".reduce_scatter" : ".allreduce"));
      size_t at = 0;
      for (Value* v : bk.members)
        if (v->producer) at = std::max<size_t>(at, static_cast<size_t>(g.index_of(v->producer)) + 1);
      Attributes a;
      a.set("bucket", static_cast<int64_t>(k));
      if (bk.sharded) {
        std::vector<int64_t> elems;
        for (Value* v : bk.members) elems.push_back(shard_readers.at(v).front()->attrs.get_int("shard_elems", 0));
        a.set("shard_elems", elems);
      }
      const std::string name = "data_parallel/bucket" + std::to_string(k);
      Node* n;
      if (bk.sharded) {
        n = g.insert_node(at, "ReduceScatter", name, bk.members, outs, a);
      } else {
        // Start after the last producer, wait before the first reader: the collective runs
        // on the communication thread while the rest of backward computes.
        Node* start = g.insert_node(at, "AllReduceStart", name + "/start", bk.members, {name + "/token"}, a);
        KILN_RETURN_IF_ERROR(infer_node(*start));
        made.insert(start);
        size_t first = g.nodes().size();
        for (Value* v : bk.members)
          for (const Use& u : g.uses(v))
            if (u.user != start) first = std::min(first, static_cast<size_t>(g.index_of(u.user)));
        first = std::max(first, static_cast<size_t>(g.index_of(start)) + 1);
        std::vector<Value*> ins = {start->outputs[0]};
        ins.insert(ins.end(), bk.members.begin(), bk.members.end());
        n = g.insert_node(first, "AllReduceWait", name, ins, outs, a);
      }
      KILN_RETURN_IF_ERROR(infer_node(*n));
      made.insert(n);
      for (size_t i = 0; i < bk.members.size(); ++i) {
        if (!bk.sharded) {
          summed[bk.members[i]] = n->outputs[i];
          continue;
        }
        for (Node* reader : shard_readers.at(bk.members[i])) {
          if (reader->attrs.get_int("shard_elems", 0) != n->outputs[i]->shape.numel())
            return Status::error("data_parallel: '" + reader->name + "' reads another shard size of '" +
                                 bk.members[i]->name + "'");
          shard_of_sum[reader->outputs[0]] = n->outputs[i];
        }
      }
    }
    for (auto& n : g.nodes()) {
      if (made.count(n.get())) continue;
      for (auto& in : n->inputs) {
        if (!in) continue;
        if (auto it = summed.find(in); it != summed.end()) in = it->second;
        if (auto it = shard_of_sum.find(in); it != shard_of_sum.end()) in = it->second;
      }
    }
    for (auto& out : g.outputs)
      if (auto it = summed.find(out); it != summed.end()) out = it->second;
    for (auto& sb : g.state)
      if (auto it = summed.find(sb.output); sb.output && it != summed.end()) sb.output = it->second;
    // The Shard nodes of the gradients are read no more.
    for (auto& [v, readers] : shard_readers)
      for (Node* r : readers) g.remove_node(r);
    // The sums take the names every reader of the program looks for ("loss",
    // "<param>.grad"); the rank's own values become "<name>.local".
    for (auto& [local, sum] : summed) {
      const std::string name = local->name;
      g.rename_value(local, name + ".local");
      g.rename_value(sum, name);
    }
    KILN_RETURN_IF_ERROR(g.topo_sort());
    return true;
  }
};

}  // namespace

std::unique_ptr<Pass> make_data_parallel_pass() { return std::make_unique<DataParallel>(); }

}  // namespace kiln::passes
