// Eager kernels of the collectives (ir/ops/collective.cpp) over the job's communicator
// (runtime/comm.h). The compiled executor runs them as it runs any library step.
#include <cstring>
#include <vector>

#include "runtime/comm.h"
#include "runtime/kernels/kernels.h"

namespace kiln::runtime::kernels {

namespace {

/// AllReduce: the bucket's inputs packed into one buffer (one collective per bucket, as
/// DDP's flat bucket views), summed over the ranks, unpacked into the outputs.
Status all_reduce_kernel(ir::KernelContext& c) {
  comm::Communicator* w = comm::world();
  if (!w)
    return c.fail(
        "needs a data-parallel job (launched by mpirun or srun with more than one rank); this process "
        "runs alone");
  const ir::DType dt = c.in(0).dtype();
  const size_t esize = ir::dtype_size(dt);
  int64_t count = 0;
  for (const ir::Tensor* t : c.inputs) count += t->numel();
  std::vector<char> flat(static_cast<size_t>(count) * esize);
  size_t at = 0;
  for (const ir::Tensor* t : c.inputs) {
    std::memcpy(flat.data() + at, t->raw(), t->nbytes());
    at += t->nbytes();
  }
  const std::string what = "bucket " + std::to_string(c.attrs().get_int("bucket", 0)) + " (" + c.node.name + ")";
  KILN_RETURN_IF_ERROR(w->all_reduce_sum(flat.data(), count, dt, what)->wait());
  at = 0;
  for (size_t i = 0; i < c.outputs.size(); ++i) {
    std::memcpy(c.out(static_cast<int>(i)).raw(), flat.data() + at, c.out(static_cast<int>(i)).nbytes());
    at += c.out(static_cast<int>(i)).nbytes();
  }
  return Status::ok();
}

}  // namespace

void register_collective_kernels(ir::OpTable& t) { set_kernel_writing_all_outputs(t, "AllReduce", all_reduce_kernel); }

}  // namespace kiln::runtime::kernels
