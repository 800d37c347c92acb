// The communication layer of data-parallel training (issue 35): collectives over MPI,
// run by one dedicated communication thread.
//
// Why a thread: neither Open MPI nor MPICH progresses a non-blocking collective unless
// some thread calls into MPI, so a collective started while the compute threads run
// backward would make no progress until its wait. The communication thread owns MPI
// (it calls MPI_Init_thread with MPI_THREAD_FUNNELED, every collective and
// MPI_Finalize); other threads hand it work and wait on a Work handle. It runs the work
// strictly in submission order, which is what MPI requires of collectives (every rank
// issues them in the same order), and polls each with MPI_Test until it completes or
// the timeout (HF's --ddp_timeout) passes: a rank that died or hangs turns into an error
// on every other rank, never a hang. A SIGINT or SIGTERM (runtime/interrupt.h) that comes
// while a collective waits gives the other ranks half a second more, then fails it: the
// launcher ends the surviving ranks of a job one of whose ranks died with SIGTERM, and
// each then says so in one line instead of being killed mid-wait.
//
// An all-reduce is a reduce-scatter followed by an all-gather (the ring algorithm's two
// halves, as NCCL and Horovod run it): each rank sums one 1/N shard and every rank
// receives the same bits. The reduce-scatter is an all-to-all of the shards and a sum in
// rank order on the owner, ((0 + x_0) + x_1) + ..., the order in which one process
// accumulates microbatches: the sums do not depend on MPI's choice of algorithm, and N
// ranks equal one process with N accumulation steps bit for bit. Bytes sent are counted
// per rank as each half's volume, (N-1)/N of the buffer each (the bandwidth-optimal
// volume that NCCL's "bus bandwidth" also reports; MPI may route the all-gather otherwise).
//
// World size 1 (no launcher, or mpirun -np 1) creates no communicator: world() is null
// and the programs hold no collective.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "ir/dtype.h"
#include "ir/status.h"

namespace kiln::runtime::comm {

/// What a collective carries: the program's data (gradient buckets, the loss) or the
/// trainer's bookkeeping scalars (the token count, the stop flag), counted apart.
enum class Traffic { data, control };

/// What a communicator did since it started (or since reset_stats): per rank.
struct CommStats {
  int64_t bytes_sent = 0;           ///< algorithmic bytes of Traffic::data this rank sent (see the file comment)
  int64_t collectives = 0;          ///< Traffic::data collectives completed (an all-reduce counts once)
  double wait_seconds = 0;          ///< time callers spent blocked in Work::wait on data (exposed communication)
  double busy_seconds = 0;          ///< time the communication thread had a data collective in flight
  int64_t control_collectives = 0;  ///< Traffic::control collectives completed
  int64_t control_bytes_sent = 0;   ///< their algorithmic bytes
};

/// A collective in flight. wait() blocks until it completed; its error (a timeout, an MPI
/// error) is returned by every wait.
class Work {
 public:
  virtual ~Work() = default;
  /// Blocks until the collective completed. Errors: the collective's (one line naming it).
  virtual Status wait() = 0;
  /// True once the collective completed (successfully or not).
  virtual bool done() const = 0;
};

/// Collectives among the ranks of one job. Buffers must stay alive and untouched until
/// the Work completes. Supported dtypes: f32, f64, i64 (sums), any for broadcast and
/// all-gather (bytes).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// Sums `count` elements of `data` over every rank, in place; every rank ends with the
  /// same bits. `what` names the collective in errors ("bucket 2").
  virtual std::shared_ptr<Work> all_reduce_sum(void* data, int64_t count, ir::DType dt, const std::string& what,
                                               Traffic traffic = Traffic::data) = 0;
  /// `send` holds world_size shards of `shard` elements; rank r receives into `recv`
  /// (`shard` elements) the sum over ranks of shard r.
  virtual std::shared_ptr<Work> reduce_scatter_sum(const void* send, void* recv, int64_t shard, ir::DType dt,
                                                   const std::string& what) = 0;
  /// Every rank contributes `shard` elements (`send`); `recv` (world_size * shard) gets
  /// them in rank order.
  virtual std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t shard, ir::DType dt,
                                           const std::string& what, Traffic traffic = Traffic::data) = 0;
  /// `bytes` bytes of `data` from rank `root` to every rank.
  virtual std::shared_ptr<Work> broadcast(void* data, int64_t bytes, int root, const std::string& what) = 0;
  /// Returns when every rank reached it. Errors: a timeout (the job's, or `timeout_seconds`
  /// when > 0: waiting for a rank that works alone, such as rank 0 evaluating).
  virtual Status barrier(const std::string& what, double timeout_seconds = 0) = 0;
  /// Counters since the start or the last reset_stats().
  virtual CommStats stats() const = 0;
  virtual void reset_stats() = 0;
  /// Seconds a collective may take before it fails (the job's --ddp_timeout).
  virtual void set_timeout(double seconds) = 0;
};

/// The world size and rank the launcher gave this process (Open MPI's
/// OMPI_COMM_WORLD_SIZE/RANK, PMIx's PMIX_SIZE/RANK as srun sets them, MPICH's and
/// Slurm's PMI_SIZE/PMI_RANK); {1, 0} when not launched as part of a job.
struct LaunchInfo {
  int world_size = 1;
  int rank = 0;
};
LaunchInfo launch_info();

/// Starts the communicator of this job when launch_info() says world_size > 1 (once per
/// process; later calls return the same). `timeout_seconds` bounds each collective.
/// Errors: kiln built without MPI, MPI_Init failing, a world size that disagrees with
/// the launcher's.
Status init_world(double timeout_seconds);
/// The job's communicator, null for one process (or before init_world).
Communicator* world();
/// Ends the communicator (MPI_Finalize; skipped after a timeout, when a peer is gone and
/// finalizing could block). Called at exit as well; idempotent.
void finalize_world();
/// True when kiln was built with MPI.
bool have_mpi();
/// " (rank R of N)" in a job of several ranks (launch_info), "" otherwise: what error lines
/// put after the program's name ("kiln (rank 1 of 2): error: ...").
std::string rank_tag();
/// Ends the whole job after an error on this rank: MPI_Abort (the launcher then stops every
/// rank) when a communicator runs, since the other ranks would otherwise wait for this one
/// in their next collective and MPI_Finalize for them; nothing for one process. Ranks
/// other than 0 wait 2 s first, so that rank 0 cleans up after an error they all meet.
/// Does not return when it aborts.
void abort_world(int code);

}  // namespace kiln::runtime::comm
