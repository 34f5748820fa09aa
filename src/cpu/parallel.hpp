// A small parallel loop for the CPU paths. Plain std::thread rather than
// OpenMP: the library is loaded into processes (PyTorch) that bring their own
// OpenMP runtime, and two OpenMP runtimes in one process crash.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace tqdecode::cpu {

/// Calls body(i) for every i in [0, count), spread over the hardware threads
/// in chunks taken from a shared counter. body(i) must write only its own
/// outputs; then results do not depend on the thread count. The first
/// exception thrown by a body is rethrown here after all threads finish.
template <typename Body>
void parallel_for(std::int64_t count, Body&& body, std::int64_t min_parallel = 2) {
  const std::int64_t threads =
      std::min<std::int64_t>(std::max(1u, std::thread::hardware_concurrency()), count);
  if (count < min_parallel || threads <= 1) {
    for (std::int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  const std::int64_t chunk = std::max<std::int64_t>(1, count / (threads * 8));
  std::atomic<std::int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    try {
      for (std::int64_t begin = next.fetch_add(chunk); begin < count; begin = next.fetch_add(chunk)) {
        const std::int64_t end = std::min(count, begin + chunk);
        for (std::int64_t i = begin; i < end; ++i) body(i);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next.store(count);
    }
  };
  std::vector<std::thread> pool;
  for (std::int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& thread : pool) thread.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace tqdecode::cpu
