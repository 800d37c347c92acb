// The communication layer over MPI (runtime/comm.h).
#include "runtime/comm.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/interrupt.h"

#ifdef KILN_HAVE_MPI
#include <mpi.h>
#endif

namespace kiln::runtime::comm {

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end && *end == 0 && x >= 0 && x < (1 << 24)) ? static_cast<int>(x) : fallback;
}

}  // namespace

std::string rank_tag() {
  const LaunchInfo li = launch_info();
  if (li.world_size <= 1) return "";
  return " (rank " + std::to_string(li.rank) + " of " + std::to_string(li.world_size) + ")";
}

LaunchInfo launch_info() {
  LaunchInfo li;
  for (auto [size, rank] : {std::pair{"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"},
                            std::pair{"PMIX_SIZE", "PMIX_RANK"}, std::pair{"PMI_SIZE", "PMI_RANK"}}) {
    int s = env_int(size, 0);
    if (s > 0) {
      li.world_size = s;
      li.rank = env_int(rank, 0);
      return li;
    }
  }
  return li;
}

#ifdef KILN_HAVE_MPI

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

MPI_Datatype mpi_type(ir::DType dt) {
  switch (dt) {
    case ir::DType::f32:
      return MPI_FLOAT;
    case ir::DType::f64:
      return MPI_DOUBLE;
    case ir::DType::i64:
      return MPI_INT64_T;
    default:
      return MPI_DATATYPE_NULL;
  }
}

std::string mpi_error_text(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, static_cast<size_t>(len));
}

/// One collective: its phases run one after another on the communication thread; each
/// starts a non-blocking MPI operation and returns its request (or an error).
struct Task : Work {
  std::string what;
  std::vector<std::function<Expected<MPI_Request>()>> phases;
  int64_t bytes = 0;  ///< algorithmic bytes this rank sends
  Traffic traffic = Traffic::data;
  double timeout = 0;  ///< > 0: this task's own timeout instead of the job's
  mutable std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  Status result = Status::ok();
  std::function<void(double)> on_wait;  ///< adds blocked time to the stats

  Status wait() override {
    auto t0 = Clock::now();
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return finished; });
    if (on_wait) on_wait(seconds_since(t0));
    return result;
  }
  bool done() const override {
    std::lock_guard<std::mutex> lk(mu);
    return finished;
  }
  void finish(Status s) {
    {
      std::lock_guard<std::mutex> lk(mu);
      finished = true;
      result = std::move(s);
    }
    cv.notify_all();
  }
};

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(double timeout) : timeout_(timeout) {}
  ~MpiCommunicator() override { stop(); }

  /// Starts the thread and MPI; returns MPI_Init's outcome.
  Status start() {
    std::promise<Status> ready;
    auto fut = ready.get_future();
    thread_ = std::thread([this, &ready] { loop(ready); });
    return fut.get();
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!thread_.joinable()) return;
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }

  std::shared_ptr<Work> all_reduce_sum(void* data, int64_t count, ir::DType dt, const std::string& what,
                                       Traffic traffic) override {
    auto t = std::make_shared<Task>();
    t->traffic = traffic;
    t->what = "all-reduce of " + what;
    if (mpi_type(dt) == MPI_DATATYPE_NULL) return failed(t, "unsupported dtype " + std::string(ir::dtype_name(dt)));
    // World-size equal shards, reduce-scattered in rank order, then all-gathered back.
    // `data` is the buffer when count divides into them (AllReduceStart pads its bucket so
    // that it does), else a zero-padded scratch copy.
    const int64_t shard = (count + size_ - 1) / size_;
    const size_t esize = ir::dtype_size(dt);
    char* out = static_cast<char*>(data);
    std::shared_ptr<std::vector<char>> scratch;
    if (shard * size_ != count) {
      scratch = std::make_shared<std::vector<char>>(static_cast<size_t>(shard * size_) * esize, 0);
      t->phases.push_back([=]() -> Expected<MPI_Request> {
        std::memcpy(scratch->data(), out, static_cast<size_t>(count) * esize);
        return MPI_REQUEST_NULL;
      });
    }
    char* buf = scratch ? scratch->data() : out;
    auto mine = std::make_shared<std::vector<char>>(static_cast<size_t>(shard) * esize, 0);
    add_reduce_scatter(*t, buf, mine->data(), shard, dt, scratch);
    t->phases.push_back([=]() -> Expected<MPI_Request> {
      MPI_Request r;
      const MPI_Datatype type = mpi_type(dt);
      int rc = MPI_Iallgather(mine->data(), static_cast<int>(shard), type, buf, static_cast<int>(shard), type,
                              MPI_COMM_WORLD, &r);
      if (rc != MPI_SUCCESS) return Status::error(mpi_error_text(rc));
      return r;
    });
    if (scratch)
      t->phases.push_back([=]() -> Expected<MPI_Request> {
        std::memcpy(out, scratch->data(), static_cast<size_t>(count) * esize);
        return MPI_REQUEST_NULL;
      });
    t->bytes = 2 * (size_ - 1) * shard * static_cast<int64_t>(esize);
    return submit(t);
  }

  std::shared_ptr<Work> reduce_scatter_sum(const void* send, void* recv, int64_t shard, ir::DType dt,
                                           const std::string& what) override {
    auto t = std::make_shared<Task>();
    t->what = "reduce-scatter of " + what;
    if (mpi_type(dt) == MPI_DATATYPE_NULL) return failed(t, "unsupported dtype " + std::string(ir::dtype_name(dt)));
    add_reduce_scatter(*t, send, recv, shard, dt, nullptr);
    t->bytes = (size_ - 1) * shard * static_cast<int64_t>(ir::dtype_size(dt));
    return submit(t);
  }

  std::shared_ptr<Work> all_gather(const void* send, void* recv, int64_t shard, ir::DType dt, const std::string& what,
                                   Traffic traffic) override {
    auto t = std::make_shared<Task>();
    t->traffic = traffic;
    t->what = "all-gather of " + what;
    const int64_t bytes = shard * static_cast<int64_t>(ir::dtype_size(dt));
    t->phases.push_back([=]() -> Expected<MPI_Request> {
      MPI_Request r;
      int rc = MPI_Iallgather(send, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes), MPI_BYTE,
                              MPI_COMM_WORLD, &r);
      if (rc != MPI_SUCCESS) return Status::error(mpi_error_text(rc));
      return r;
    });
    t->bytes = (size_ - 1) * bytes;
    return submit(t);
  }

  std::shared_ptr<Work> broadcast(void* data, int64_t bytes, int root, const std::string& what) override {
    auto t = std::make_shared<Task>();
    t->what = "broadcast of " + what;
    t->phases.push_back([=]() -> Expected<MPI_Request> {
      MPI_Request r;
      int rc = MPI_Ibcast(data, static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD, &r);
      if (rc != MPI_SUCCESS) return Status::error(mpi_error_text(rc));
      return r;
    });
    t->bytes = rank_ == root ? bytes : 0;
    return submit(t);
  }

  Status barrier(const std::string& what, double timeout_seconds) override {
    auto t = std::make_shared<Task>();
    t->what = "barrier " + what;
    t->traffic = Traffic::control;
    t->timeout = timeout_seconds;
    t->phases.push_back([]() -> Expected<MPI_Request> {
      MPI_Request r;
      int rc = MPI_Ibarrier(MPI_COMM_WORLD, &r);
      if (rc != MPI_SUCCESS) return Status::error(mpi_error_text(rc));
      return r;
    });
    return submit(t)->wait();
  }

  CommStats stats() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return stats_;
  }
  void reset_stats() override {
    std::lock_guard<std::mutex> lk(mu_);
    stats_ = CommStats{};
  }
  void set_timeout(double seconds) override {
    std::lock_guard<std::mutex> lk(mu_);
    timeout_ = seconds;
  }
  bool broken() const {
    std::lock_guard<std::mutex> lk(mu_);
    return broken_;
  }
  /// Asks the communication thread to MPI_Abort the job (it makes every MPI call).
  void request_abort(int code) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      abort_code_ = code;
    }
    cv_.notify_all();
  }

 private:
  /// Phases of a reduce-scatter whose sums are the same bits on every machine and for
  /// every MPI build: an all-to-all hands rank r shard r of every rank, then rank r adds
  /// them in rank order starting from +0, ((0 + x_0) + x_1) + ..., which is also the
  /// order in which one process accumulates N microbatches (passes/accumulation.cpp), so
  /// N ranks equal one process with --gradient_accumulation_steps N bit for bit. (MPI's
  /// own reduce-scatter picks its summation order by message size and world size.)
  /// `keep` holds buffers the phases use.
  void add_reduce_scatter(Task& t, const void* send, void* recv, int64_t shard, ir::DType dt,
                          std::shared_ptr<void> keep) {
    const size_t esize = ir::dtype_size(dt);
    auto parts = std::make_shared<std::vector<char>>(static_cast<size_t>(shard * size_) * esize);
    const int n = size_;
    t.phases.push_back([=]() -> Expected<MPI_Request> {
      MPI_Request r;
      const MPI_Datatype type = mpi_type(dt);
      int rc = MPI_Ialltoall(send, static_cast<int>(shard), type, parts->data(), static_cast<int>(shard), type,
                             MPI_COMM_WORLD, &r);
      if (rc != MPI_SUCCESS) return Status::error(mpi_error_text(rc));
      return r;
    });
    t.phases.push_back([=]() -> Expected<MPI_Request> {
      (void)keep;
      auto sum = [&](auto zero) {
        using T = decltype(zero);
        const T* in = reinterpret_cast<const T*>(parts->data());
        T* o = static_cast<T*>(recv);
        for (int64_t i = 0; i < shard; ++i) {
          T acc = zero;
          for (int r = 0; r < n; ++r) acc = acc + in[static_cast<int64_t>(r) * shard + i];
          o[i] = acc;
        }
      };
      if (dt == ir::DType::f32)
        sum(0.0f);
      else if (dt == ir::DType::f64)
        sum(0.0);
      else
        sum(int64_t(0));
      return MPI_REQUEST_NULL;
    });
  }

  std::shared_ptr<Work> failed(const std::shared_ptr<Task>& t, const std::string& why) {
    t->finish(Status::error(t->what + ": " + why));
    return t;
  }

  std::shared_ptr<Work> submit(const std::shared_ptr<Task>& t) {
    t->on_wait = [this, control = t->traffic == Traffic::control](double s) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!control) stats_.wait_seconds += s;
    };
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (broken_) {
        t->finish(Status::error(t->what + ": the job's communication failed earlier (" + broken_why_ + ")"));
        return t;
      }
      queue_.push_back(t);
    }
    cv_.notify_all();
    return t;
  }

  /// Polls `r` until it completes or the deadline passes, sleeping between tests (from
  /// 2 us up to 200 us) so the thread does not take a core from the compute threads. A
  /// stop signal shortens the deadline to half a second from its arrival.
  Status poll(MPI_Request& r, Clock::time_point deadline, double timeout) {
    std::chrono::microseconds nap(2);
    bool signalled = false;
    while (true) {
      int flag = 0;
      int rc = MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return Status::error(mpi_error_text(rc));
      if (flag) return Status::ok();
      abort_if_requested();
      if (const int sig = stop_signal(); sig != 0 && !signalled) {
        signalled = true;
        deadline = std::min(deadline, Clock::now() + std::chrono::milliseconds(500));
      }
      if (Clock::now() > deadline && signalled)
        return Status::error(std::string(signal_name(stop_signal())) +
                             " while waiting for the other ranks (the launcher ends the job: a rank died?)");
      if (Clock::now() > deadline) {
        char buf[64];
        std::snprintf(buf, sizeof(buf), "%g", timeout);
        return Status::error(std::string("no answer from the other ranks within --ddp_timeout ") + buf +
                             " s (a rank died or hangs)");
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(200));
    }
  }

  void loop(std::promise<Status>& ready) {
    int provided = 0;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) {
      ready.set_value(Status::error("MPI_Init_thread failed: " + mpi_error_text(rc)));
      return;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    ready.set_value(Status::ok());
    while (true) {
      std::shared_ptr<Task> t;
      double timeout;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stopping_ || !queue_.empty() || abort_code_ >= 0; });
        if (abort_code_ >= 0) {
          lk.unlock();
          abort_if_requested();
        }
        if (queue_.empty()) break;  // stopping, nothing left
        t = queue_.front();
        queue_.pop_front();
        timeout = t->timeout > 0 ? t->timeout : timeout_;
      }
      const auto t0 = Clock::now();
      const auto deadline = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout));
      Status s = Status::ok();
      for (auto& phase : t->phases) {
        auto req = phase();
        if (!req) {
          s = req.status();
          break;
        }
        MPI_Request r = *req;
        if (r == MPI_REQUEST_NULL) continue;
        s = poll(r, deadline, timeout);
        if (!s) break;
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        const bool control = t->traffic == Traffic::control;
        if (!control) stats_.busy_seconds += seconds_since(t0);
        if (s && control) {
          stats_.control_bytes_sent += t->bytes;
          stats_.control_collectives += 1;
        } else if (s) {
          stats_.bytes_sent += t->bytes;
          stats_.collectives += 1;
        } else {
          broken_ = true;
          broken_why_ = s.message();
        }
      }
      t->finish(s ? s
                  : Status::error(t->what + " (rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
                                  "): " + s.message()));
    }
    // A request left pending after a timeout would make MPI_Finalize wait for a dead peer.
    if (!broken()) MPI_Finalize();
  }

  void abort_if_requested() {
    int code;
    {
      std::lock_guard<std::mutex> lk(mu_);
      code = abort_code_;
    }
    if (code >= 0) MPI_Abort(MPI_COMM_WORLD, code);
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  int abort_code_ = -1;
  std::deque<std::shared_ptr<Task>> queue_;
  std::thread thread_;
  bool stopping_ = false;
  bool broken_ = false;
  std::string broken_why_;
  double timeout_;
  CommStats stats_;
  int rank_ = 0, size_ = 1;
};

std::unique_ptr<MpiCommunicator>& world_ptr() {
  static std::unique_ptr<MpiCommunicator> w;
  return w;
}

}  // namespace

Status init_world(double timeout_seconds) {
  const LaunchInfo li = launch_info();
  if (li.world_size <= 1) return Status::ok();
  auto& w = world_ptr();
  if (w) {
    w->set_timeout(timeout_seconds);
    return Status::ok();
  }
  auto c = std::make_unique<MpiCommunicator>(timeout_seconds);
  KILN_RETURN_IF_ERROR(c->start());
  if (c->world_size() != li.world_size)
    return Status::error("MPI reports " + std::to_string(c->world_size()) + " ranks, the launcher " +
                         std::to_string(li.world_size));
  w = std::move(c);
  std::atexit(finalize_world);
  return Status::ok();
}

Communicator* world() { return world_ptr().get(); }

void abort_world(int code) {
  auto& w = world_ptr();
  if (!w) return;
  std::fflush(nullptr);
  if (!w->broken()) {
    // Rank 0 first: an error every rank meets (a refused flag) reaches them all at about
    // the same time, and rank 0 removes what the command created in output_dir (its
    // OutputGuard) before it aborts; an abort from another rank would kill it mid-way.
    if (w->rank() != 0) std::this_thread::sleep_for(std::chrono::seconds(2));
    w->request_abort(code);
    std::this_thread::sleep_for(std::chrono::seconds(5));  // MPI_Abort ends the process before
  }
  std::_Exit(code);  // a communicator past a timeout: finalizing could wait for a dead peer
}

void finalize_world() { world_ptr().reset(); }

bool have_mpi() { return true; }

#else  // !KILN_HAVE_MPI

Status init_world(double) {
  const LaunchInfo li = launch_info();
  if (li.world_size <= 1) return Status::ok();
  return Status::error("this kiln was built without MPI (libopenmpi-dev): it cannot train on " +
                       std::to_string(li.world_size) + " ranks");
}
Communicator* world() { return nullptr; }
void finalize_world() {}
void abort_world(int) {}
bool have_mpi() { return false; }

#endif

}  // namespace kiln::runtime::comm
