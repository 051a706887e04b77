// The native kernels' thread pool (parallel.h says why it exists): workers that spin for a
// short while after each parallel region before they sleep, so a step's regions, a few
// microseconds apart, find them awake, and an idle engine holds no CPU.
//
// One job at a time: a generation number, the job's task count and the next unclaimed
// task share one 64-bit ticket, which the caller and the workers claim tasks from by
// compare-and-swap; a claim fails once the ticket has moved to another generation, so a
// worker that wakes late can never run a task of a job it did not see published. The
// caller claims tasks too and waits for the claimed ones to finish; a task nobody has
// claimed yet (a worker still asleep or descheduled) it runs itself.

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <pthread.h>
#include <strings.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <exception>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include "parallel.h"

namespace pagedserve {
namespace {

// How long a worker spins for the next job before it sleeps; and how long the caller
// spins for the workers' tasks before it yields its CPU between looks.
constexpr auto kSpin = std::chrono::microseconds(50);
// Ticket fields: generation (24 bits), task count (20), next task (20).
constexpr int kNextBits = 20, kTaskBits = 20;
constexpr uint64_t kFieldMask = (uint64_t{1} << kNextBits) - 1;
constexpr int64_t kMaxTasks = int64_t{1} << kTaskBits;

thread_local bool t_in_task = false;

inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Calls `poll` until it returns true: spinning for kSpin, then `wait` between polls.
template <typename Poll, typename Wait>
void spin_then(const Poll& poll, const Wait& wait) {
  auto start = std::chrono::steady_clock::now();
  for (int i = 1; !poll(); ++i) {
    cpu_pause();
    if ((i & 63) == 0 && std::chrono::steady_clock::now() - start > kSpin) {
      wait();
      start = std::chrono::steady_clock::now();
    }
  }
}

class Pool {
 public:
  // Runs fn(0..tasks-1), each once, on the caller and up to tasks - 1 workers.
  void run(int64_t tasks, const TaskFn& fn) {
    std::unique_lock<std::mutex> lock(caller_, std::try_to_lock);
    if (!lock.owns_lock() || tasks >= kMaxTasks) {  // another thread's job is running
      run_serially(tasks, fn);
      return;
    }
    grow(tasks - 1);
    fn_ = &fn;
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    generation_counter_ = (generation_counter_ + 1) & 0xFFFFFF;
    if (generation_counter_ == 0) generation_counter_ = 1;
    const uint64_t gen = generation_counter_;
    ticket_.store((gen << (kTaskBits + kNextBits)) | (static_cast<uint64_t>(tasks) << kNextBits),
                  std::memory_order_release);
    generation_.store(static_cast<uint32_t>(gen));
    if (sleepers_.load() > 0) generation_.notify_all();
    run_claims(gen);
    spin_then([&] { return done_.load(std::memory_order_acquire) == tasks; },
              [] { std::this_thread::yield(); });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static void run_serially(int64_t tasks, const TaskFn& fn) {
    for (int64_t t = 0; t < tasks; ++t) fn(t);
  }

  // Starts workers until there are `count`.
  void grow(int64_t count) {
    while (static_cast<int64_t>(workers_) < count) {
      std::thread([this] { work(); }).detach();
      ++workers_;
    }
  }

  bool claim(uint64_t gen, int64_t& task) {
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if ((ticket >> (kTaskBits + kNextBits)) != gen) return false;
      const uint64_t tasks = (ticket >> kNextBits) & kFieldMask, next = ticket & kFieldMask;
      if (next >= tasks) return false;
      if (ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire)) {
        task = static_cast<int64_t>(next);
        return true;
      }
    }
  }

  // Runs this generation's tasks until none is left to claim.
  void run_claims(uint64_t gen) {
    t_in_task = true;
    for (int64_t task; claim(gen, task);) {
      try {
        (*fn_)(task);
      } catch (...) {
        std::lock_guard<std::mutex> guard(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
    t_in_task = false;
  }

  void work() {
    uint32_t seen = generation_.load();
    for (;;) {
      uint32_t gen = seen;
      spin_then([&] { return (gen = generation_.load(std::memory_order_acquire)) != seen; },
                [&] {
                  sleepers_.fetch_add(1);
                  generation_.wait(seen);
                  sleepers_.fetch_sub(1);
                });
      seen = gen;
      run_claims(gen);
    }
  }

  std::mutex caller_;
  int64_t workers_ = 0;            // under caller_
  uint32_t generation_counter_ = 0;  // under caller_
  const TaskFn* fn_ = nullptr;
  std::exception_ptr error_;
  std::mutex error_mutex_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<uint32_t> generation_{0};  // the futex sleeping workers wait on
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> done_{0};
};

std::atomic<Pool*> g_pool{nullptr};
std::once_flag g_atfork;

Pool& pool() {
  std::call_once(g_atfork, [] {
    // A forked child has none of the parent's threads: it starts a pool of its own (the
    // parent's object is left as it is).
    pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr); });
  });
  Pool* current = g_pool.load(std::memory_order_acquire);
  if (current == nullptr) {
    Pool* fresh = new Pool();  // never destroyed: its workers sleep until the process ends
    if (g_pool.compare_exchange_strong(current, fresh)) return *fresh;
    delete fresh;
  }
  return *current;
}

}  // namespace

// Whether torch's OpenMP threads sleep at their barriers (OMP_WAIT_POLICY=PASSIVE, which
// libgomp reads once, at load). Only then does the pool pay: where they spin (libgomp's
// default, or a GOMP_SPINCOUNT), they are awake for the next region already, and a pool
// beside them would compete with their spinning for the same cores (a 2-layer model's
// offline run took 3.8-3.9 s on the pool against 2.4 s on OpenMP, default policy).
bool openmp_threads_sleep() {
  static const bool passive = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    return policy != nullptr && strcasecmp(policy, "passive") == 0;
  }();
  return passive;
}

void run_tasks(int64_t tasks, const TaskFn& fn) {
  if (tasks <= 1 || t_in_task || at::in_parallel_region()) {
    for (int64_t t = 0; t < tasks; ++t) fn(t);
    return;
  }
  if (!openmp_threads_sleep()) {
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) fn(t);
    });
    return;
  }
  pool().run(tasks, fn);
}

}  // namespace pagedserve

// For the tests (tests/engine/ops/test_thread_pool.py): parallel_for over [begin, end) that
// counts the times each index ran and the distinct threads that ran chunks, and throws from
// the chunk holding index `throw_at` (-1: none); and whether regions run on the pool.
namespace {

std::tuple<at::Tensor, int64_t, bool> parallel_probe(int64_t begin, int64_t end, int64_t grain,
                                               int64_t throw_at) {
  at::Tensor counts = at::zeros({std::max<int64_t>(0, end - begin)}, at::kInt);
  auto* c = reinterpret_cast<std::atomic<int32_t>*>(counts.data_ptr<int32_t>());
  std::mutex mutex;
  std::set<std::thread::id> threads;
  pagedserve::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    {
      std::lock_guard<std::mutex> guard(mutex);
      threads.insert(std::this_thread::get_id());
    }
    for (int64_t i = b; i < e; ++i) {
      c[i - begin].fetch_add(1);
      TORCH_CHECK(i != throw_at, "thrown at ", i);
    }
  });
  return {counts, static_cast<int64_t>(threads.size()), pagedserve::openmp_threads_sleep()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("_parallel_probe(int begin, int end, int grain, int throw_at) -> (Tensor, int, bool)",
        &parallel_probe);
}
