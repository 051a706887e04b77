// Splitting a linear layer's output tiles over torch's threads (TileClaims, kernels.h).
//
// at::parallel_for hands each thread a fixed share of the range, so when the OS takes one
// thread off its core for a while (the HTTP server's event loop, a client or another
// process on the same cores), the others finish their shares and wait at the barrier. Here
// each thread claims the next run of tiles until none are left: a thread held back delays
// only the run it holds. Served, 64 streams of 200 tokens in and 128 out went from 119-132
// to 134-143 output tok/s (five pairs, alternating, on a 2-core AVX2 machine).
//
// Where torch's OpenMP threads sleep at every barrier (OMP_WAIT_POLICY=PASSIVE, the engine
// core's default, for a shared CPU's sake), the kernels' parallel regions run on a pool of
// their own (thread_pool.cpp): waking a sleeping thread costs tens of microseconds on some
// VMs, and a step of 30 layers crosses some 150 regions. The pool's workers spin for a
// short while (kSpin) after each region before they sleep, so a step's regions,
// microseconds apart, find them awake; between steps they sleep. Where OpenMP's threads
// spin, they are awake already, and the regions run on them. As many threads as
// at::get_num_threads() says take part, so StepThreads' choice holds.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace pagedserve {

// A reference to a callable taking a task index (the callable outlives the call).
class TaskFn {
 public:
  template <typename F>
  explicit TaskFn(const F& f)
      : object_(&f), call_([](const void* o, int64_t t) { (*static_cast<const F*>(o))(t); }) {}
  void operator()(int64_t task) const { call_(object_, task); }

 private:
  const void* object_;
  void (*call_)(const void*, int64_t);
};

// Runs fn(0), ..., fn(tasks - 1), each once, on the calling thread and the pool's; returns
// when all have; rethrows the first exception a task threw. Inside a task (or an OpenMP
// region) the tasks run one after another on the calling thread.
void run_tasks(int64_t tasks, const TaskFn& fn);

// at::parallel_for's contract on the pool: f(b, e) over contiguous chunks of
// [begin, end), one per thread, as at::parallel_for splits them (at most
// at::get_num_threads() chunks of at least `grain`).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t range = end - begin, g = std::max<int64_t>(1, grain);
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), (range + g - 1) / g);
  if (tasks <= 1) {
    f(begin, end);
    return;
  }
  const int64_t chunk = (range + tasks - 1) / tasks;
  const auto task = [&](int64_t t) {
    const int64_t b = begin + t * chunk;
    if (b < end) f(b, std::min(end, b + chunk));
  };
  run_tasks(tasks, TaskFn(task));
}

// Runs task(claims) once on each of up to tiles / grain threads (grain: the fewest tiles
// worth a thread's start). They claim runs of tiles until none are left, each run at least
// kClaimFlops of arithmetic (flops_per_tile each). At a decode step's few rows that is a
// thread's whole share: each thread then gets a fixed share, as from at::parallel_for
// (its weights stream from memory, and one long run keeps the prefetcher ahead); at a
// prefill's, the runs come down to a tile or two.
// The least arithmetic a claim of tiles takes (parallel_tiles).
constexpr int64_t kClaimFlops = int64_t{1} << 22;

template <typename F>
void parallel_tiles(int64_t tiles, int64_t grain, int64_t flops_per_tile, const F& task) {
  grain = std::max<int64_t>(1, grain);
  const int64_t tasks = std::clamp<int64_t>((tiles + grain - 1) / grain, 1, at::get_num_threads());
  const int64_t share = (tiles + tasks - 1) / tasks;
  const int64_t min_chunk = kClaimFlops / std::max<int64_t>(1, flops_per_tile);
  if (min_chunk >= share) {
    parallel_for(0, tiles, share, [&](int64_t begin, int64_t end) {
      TileClaims own(begin, end, end - begin, 1);
      task(own);
    });
    return;
  }
  TileClaims claims(0, tiles, min_chunk, tasks);
  parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) task(claims);
  });
}

}  // namespace pagedserve
