// Eager kernels of the collectives (ir/ops/collective.cpp) over the job's communicator
// (runtime/comm.h). The compiled executor runs them as it runs any library step.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/comm.h"
#include "runtime/kernels/kernels.h"

namespace kiln::runtime::kernels {

namespace {

Expected<comm::Communicator*> job(ir::KernelContext& c) {
  comm::Communicator* w = comm::world();
  if (!w)
    return c.fail(
        "needs a data-parallel job (launched by mpirun or srun with more than one rank); this process "
        "runs alone");
  return w;
}

/// The bucket's name in the communication layer's errors.
std::string bucket_of(const ir::KernelContext& c) {
  return "bucket " + std::to_string(c.attrs().get_int("bucket", 0)) + " (" + c.node.name + ")";
}

/// Copies consecutive parts of `packed` into the outputs, in order.
void unpack(ir::KernelContext& c, const char* packed) {
  for (size_t i = 0; i < c.outputs.size(); ++i) {
    ir::Tensor& o = c.out(static_cast<int>(i));
    std::memcpy(o.raw(), packed, o.nbytes());
    packed += o.nbytes();
  }
}

/// The all-reduces in flight between an AllReduceStart and its AllReduceWait, by bucket:
/// the Work and the packed buffer the communication thread sums in place.
struct InFlight {
  std::shared_ptr<comm::Work> work;
  std::shared_ptr<std::vector<char>> flat;
};
std::mutex g_in_flight_mu;
std::map<int64_t, InFlight> g_in_flight;

/// AllReduceStart: packs the bucket into one buffer (DDP's flat bucket), zero-padded to a
/// multiple of the world size so that the communication layer sums it in place, and
/// hands it to the communication thread.
Status all_reduce_start_kernel(ir::KernelContext& c) {
  KILN_ASSIGN_OR_RETURN(comm::Communicator * w, job(c));
  const ir::DType dt = c.in(0).dtype();
  int64_t count = 0;
  for (const ir::Tensor* t : c.inputs) count += t->numel();
  count = (count + w->world_size() - 1) / w->world_size() * w->world_size();
  auto flat = std::make_shared<std::vector<char>>(static_cast<size_t>(count) * ir::dtype_size(dt));
  size_t at = 0;
  for (const ir::Tensor* t : c.inputs) {
    std::memcpy(flat->data() + at, t->raw(), t->nbytes());
    at += t->nbytes();
  }
  std::memset(flat->data() + at, 0, flat->size() - at);
  const int64_t bucket = c.attrs().get_int("bucket", 0);
  auto work = w->all_reduce_sum(flat->data(), count, dt, bucket_of(c));
  {
    std::lock_guard<std::mutex> lk(g_in_flight_mu);
    if (g_in_flight.count(bucket)) return c.fail("bucket " + std::to_string(bucket) + " is already in flight");
    g_in_flight[bucket] = {std::move(work), std::move(flat)};
  }
  c.out(0).set_f64(0, static_cast<double>(bucket));
  return Status::ok();
}

/// AllReduceWait: waits for the bucket's all-reduce and unpacks the sums.
Status all_reduce_wait_kernel(ir::KernelContext& c) {
  const int64_t bucket = c.attrs().get_int("bucket", 0);
  InFlight f;
  {
    std::lock_guard<std::mutex> lk(g_in_flight_mu);
    auto it = g_in_flight.find(bucket);
    if (it == g_in_flight.end()) return c.fail("no all-reduce of bucket " + std::to_string(bucket) + " in flight");
    f = std::move(it->second);
    g_in_flight.erase(it);
  }
  KILN_RETURN_IF_ERROR(f.work->wait());
  unpack(c, f.flat->data());
  return Status::ok();
}

/// Copies this rank's shard [rank * s, rank * s + s) of the flat `n`-element tensor at
/// `x` (elements of `esize` bytes) into `out`, zeros past its end.
void copy_shard(const char* x, int64_t n, int64_t s, int64_t rank, size_t esize, char* out) {
  const int64_t begin = std::min(n, rank * s), end = std::min(n, rank * s + s);
  std::memcpy(out, x + begin * esize, static_cast<size_t>(end - begin) * esize);
  std::memset(out + (end - begin) * esize, 0, static_cast<size_t>(s - (end - begin)) * esize);
}

/// Shard: this rank's slice of the flattened input, no communication.
Status shard_kernel(ir::KernelContext& c) {
  KILN_ASSIGN_OR_RETURN(comm::Communicator * w, job(c));
  const ir::Tensor& x = c.in(0);
  copy_shard(static_cast<const char*>(x.raw()), x.numel(), c.out(0).numel(), w->rank(), ir::dtype_size(x.dtype()),
             static_cast<char*>(c.out(0).raw()));
  return Status::ok();
}

/// ReduceScatter: the bucket laid out rank by rank (rank q's part: the q-th shard of
/// every input, in input order), reduce-scattered in one collective; this rank's part
/// unpacked into the outputs.
Status reduce_scatter_kernel(ir::KernelContext& c) {
  KILN_ASSIGN_OR_RETURN(comm::Communicator * w, job(c));
  const int n = w->world_size();
  const ir::DType dt = c.in(0).dtype();
  const size_t esize = ir::dtype_size(dt);
  int64_t part = 0;  // elements of one rank's part
  for (size_t i = 0; i < c.outputs.size(); ++i) part += c.out(static_cast<int>(i)).numel();
  std::vector<char> send(static_cast<size_t>(part * n) * esize), recv(static_cast<size_t>(part) * esize);
  size_t at = 0;
  for (int q = 0; q < n; ++q)
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      const int64_t s = c.out(static_cast<int>(i)).numel();
      copy_shard(static_cast<const char*>(c.inputs[i]->raw()), c.inputs[i]->numel(), s, q, esize, send.data() + at);
      at += static_cast<size_t>(s) * esize;
    }
  KILN_RETURN_IF_ERROR(w->reduce_scatter_sum(send.data(), recv.data(), part, dt, bucket_of(c))->wait());
  unpack(c, recv.data());
  return Status::ok();
}

/// AllGather: every rank's shard, in rank order, cut to the output's elements.
Status all_gather_kernel(ir::KernelContext& c) {
  KILN_ASSIGN_OR_RETURN(comm::Communicator * w, job(c));
  const ir::Tensor& x = c.in(0);
  std::vector<char> all(x.nbytes() * static_cast<size_t>(w->world_size()));
  KILN_RETURN_IF_ERROR(w->all_gather(x.raw(), all.data(), x.numel(), x.dtype(), c.node.name)->wait());
  std::memcpy(c.out(0).raw(), all.data(), c.out(0).nbytes());
  return Status::ok();
}

}  // namespace

// Plain set_kernel (outputs zero-filled first): tests/runtime/kernel_writes_test.cpp runs
// every kernel flagged as writing all outputs alone, and these need a job.
void register_collective_kernels(ir::OpTable& t) {
  set_kernel(t, "AllReduceStart", all_reduce_start_kernel);
  set_kernel(t, "AllReduceWait", all_reduce_wait_kernel);
  set_kernel(t, "ReduceScatter", reduce_scatter_kernel);
  set_kernel(t, "Shard", shard_kernel);
  set_kernel(t, "AllGather", all_gather_kernel);
}

}  // namespace kiln::runtime::kernels
