// Shared by the native CPU kernels (compiled into one library): work split over XLA's intra-op
// thread pool.
#ifndef LM_PIPELINE_CPU_PARALLEL_H_
#define LM_PIPELINE_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace lm_pipeline_native {

// Runs f(i) for i in [0, n) on the calling thread and XLA's intra-op pool. Tasks that start
// after all items are claimed touch only the shared counters, so the caller never waits on
// a task that has not started (no deadlock when every pool thread is inside such a call).
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, const F& f) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  auto run = [st, n](const F* fp) {
    for (;;) {
      const int64_t i = st->next.fetch_add(1);
      if (i >= n) return;
      (*fp)(i);
      if (st->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(st->mu);
        st->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  const F* fp = &f;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([run, fp] { run(fp); });
  run(fp);
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == n; });
}

}  // namespace lm_pipeline_native

#endif  // LM_PIPELINE_CPU_PARALLEL_H_
