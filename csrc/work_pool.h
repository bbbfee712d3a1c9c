// Chunks of one matmul over the threads, for calls too short for OpenMP's fork-join (a decode
// step's matmuls take 10 us - 1 ms each, ~120 of them a step).
//
// at::parallel_for splits a range into one static share per thread and joins them all: when the
// OS has descheduled one thread (another process on its core), the caller finishes its share and
// waits for that thread's next time slice (measured on a 2-core machine shared with builds: 0.1 ms
// calls taking 8-12 ms, the median decode step of a 135M model 14 ms with one thread and 50 ms with
// two). Here:
//
// - the work is several chunks per thread, claimed one at a time from an atomic ticket; the caller
//   claims chunks too, so a worker that has not started yet simply finds nothing left;
// - a worker computes its chunk into its own scratch and publishes it only if the chunk is still
//   its own (one compare-and-swap, then a copy); when the caller runs out of chunks it takes back
//   those workers are still computing and computes them itself. So the caller never waits on a
//   descheduled worker, only (rarely) on one in the middle of publishing a chunk.
//
// A worker whose chunk was taken back may still be reading the call's inputs when the caller has
// moved on; it notices at its next row and stops. Those inputs must therefore stay allocated until
// quiesce() returns, which waits until no worker is inside a chunk: the activations are per-thread
// buffers grown only after it; the weights and KV pages are the model's (LlamaModel and KVCache call
// pagedecode._cpu.quiesce before they can be freed); quant_linear, given blocks from Python, calls
// it after each call.
// Waiting there instead, at the end of every forward, put a descheduled worker's time slice back
// into most steps on a loaded machine.
//
// That is for a gemv's few rows. From kOpenMPRows rows, run() below gives the chunks to OpenMP's
// threads instead (claimed from one counter, then joined): the forward's other loops run there, and
// two pools spinning after their work took each other's cores on a quiet machine, which cost more
// than the join's exposure to a descheduled thread (see run()).
//
// The chunking (which rows each chunk holds) does not depend on who runs a chunk, so results are
// the same bit for bit at any thread count and under any scheduling. Workers (threads - 1 of them,
// at::get_num_threads() at the call) spin on the ticket for a while after each job (the next
// matmul of a step comes microseconds later), then sleep on a condition variable.

#pragma once

#include <ATen/Parallel.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace work {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Whether the chunk a worker computes is still its own (checked between rows).
struct Live {
  const std::atomic<uint64_t>* state;
  uint64_t mine;
  bool operator()() const { return state == nullptr || state->load(std::memory_order_relaxed) == mine; }
};

class Pool {
 public:
  static constexpr int64_t kMaxChunks = 256;
  static constexpr size_t kJobBytes = 256;

  // The pool for the current thread count (rebuilt when it changes, and in a forked child, which
  // has none of its parent's threads). An old pool is left idle, never destroyed.
  static Pool& get() {
    const int threads = std::max(1, at::get_num_threads());
    std::lock_guard<std::mutex> lock(registry_mutex());
    Pool*& pool = current();
    if (pool == nullptr || pool->threads_ != threads || pool->pid_ != getpid()) {
      pool = new Pool(threads);
      every().push_back(pool);
    }
    return *pool;
  }

  // Waits until no worker of any of this process's pools is inside a chunk (a worker of a pool
  // left behind by a thread-count change may still be finishing one); starts no pool.
  static void quiesce_all() {
    std::vector<Pool*> pools;
    {
      std::lock_guard<std::mutex> lock(registry_mutex());
      pools = every();
    }
    for (Pool* pool : pools)
      if (pool->pid_ == getpid()) pool->quiesce();
  }

  int threads() const { return threads_; }

  // For each chunk c in [0, n), exactly one of: job.compute(c, nullptr, live) writing the output
  // in place (the caller), or job.compute(c, scratch, live) into a worker's scratch followed by
  // job.commit(c, scratch). Job: trivially copyable, at most kJobBytes; compute returns false if
  // it stopped because live() turned false.
  template <typename Job>
  void run(int64_t n, const Job& job) {
    static_assert(std::is_trivially_copyable_v<Job> && sizeof(Job) <= kJobBytes);
    if (n <= 0) return;
    if (n == 1 || workers_.empty() || n > kMaxChunks) {
      for (int64_t c = 0; c < n; ++c) job.compute(c, nullptr, Live{nullptr, 0});
      return;
    }
    const uint64_t epoch = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    Slot& slot = slots_[epoch & 1];
    slot.seq.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    std::memcpy(slot.job, &job, sizeof(Job));
    slot.run = [](const void* j, int64_t c, std::vector<float>* scratch, Live live) {
      const Job& job = *static_cast<const Job*>(j);
      if (!job.compute(c, scratch, live)) return false;
      return true;
    };
    slot.commit = [](const void* j, int64_t c, std::vector<float>* scratch) {
      static_cast<const Job*>(j)->commit(c, scratch);
    };
    slot.seq.store(epoch, std::memory_order_release);
    for (int64_t c = 0; c < n; ++c) state_[c].store(epoch << 2 | kComputing, std::memory_order_relaxed);
    ticket_.store(epoch << 32 | static_cast<uint64_t>(n) << 16, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(m_);
      cv_.notify_all();
    }
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {                                              // the caller's own chunks
      const uint64_t next = t & 0xffff;
      if (next >= static_cast<uint64_t>(n)) break;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      job.compute(static_cast<int64_t>(next), nullptr, Live{nullptr, 0});
      state_[next].store(epoch << 2 | kDone, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
    for (int64_t c = 0; c < n; ++c) {                       // the workers': done, or taken back
      uint64_t s = state_[c].load(std::memory_order_acquire);
      if (s == (epoch << 2 | kComputing) &&
          state_[c].compare_exchange_strong(s, epoch << 2 | kTaken, std::memory_order_acq_rel)) {
        job.compute(c, nullptr, Live{nullptr, 0});
        continue;
      }
      for (int64_t spins = 0; state_[c].load(std::memory_order_acquire) != (epoch << 2 | kDone); ++spins) {
        if (spins < 4096) cpu_relax();                      // a worker is copying its chunk out
        else std::this_thread::yield();
      }
    }
  }

  // Waits until no worker of this pool is inside a chunk (see the top of this file; quiesce_all
  // is what protects buffers).
  void quiesce() {
    for (int64_t spins = 0; active_.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < 4096) cpu_relax();
      else std::this_thread::yield();
    }
  }

 private:
  static constexpr uint64_t kComputing = 0, kTaken = 1, kCommitting = 2, kDone = 3;

  static std::mutex& registry_mutex() {
    static std::mutex m;
    return m;
  }
  static Pool*& current() {
    static Pool* pool = nullptr;
    return pool;
  }
  static std::vector<Pool*>& every() {
    static std::vector<Pool*> pools;
    return pools;
  }

  struct Slot {
    std::atomic<uint64_t> seq{0};                  // the epoch whose job this holds; 0 while written
    alignas(64) unsigned char job[kJobBytes];
    bool (*run)(const void*, int64_t, std::vector<float>*, Live) = nullptr;
    void (*commit)(const void*, int64_t, std::vector<float>*) = nullptr;
  };

  explicit Pool(int threads) : threads_(threads), pid_(getpid()) {
    for (int t = 1; t < threads; ++t) workers_.emplace_back([this] { loop(); });
    for (auto& w : workers_) w.detach();
  }

  // a worker: claims chunks of job `epoch` until none is left
  void work(uint64_t epoch, std::vector<float>& scratch) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = t & 0xffff, n = (t >> 16) & 0xffff;
      if ((t >> 32) != epoch || next >= n) return;
      active_.fetch_add(1, std::memory_order_seq_cst);
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        active_.fetch_sub(1, std::memory_order_release);
        continue;
      }
      // the job as it was published (the slot is rewritten two jobs later: checked around the copy)
      const Slot& slot = slots_[epoch & 1];
      alignas(64) unsigned char job[kJobBytes];
      bool ok = slot.seq.load(std::memory_order_acquire) == epoch;
      auto* run = slot.run;
      auto* commit = slot.commit;
      std::memcpy(job, slot.job, kJobBytes);
      std::atomic_thread_fence(std::memory_order_acquire);
      ok = ok && slot.seq.load(std::memory_order_relaxed) == epoch;
      std::atomic<uint64_t>& state = state_[next];
      const uint64_t mine = epoch << 2 | kComputing;
      if (ok && run(job, static_cast<int64_t>(next), &scratch, Live{&state, mine})) {
        uint64_t s = mine;
        if (state.compare_exchange_strong(s, epoch << 2 | kCommitting, std::memory_order_acq_rel)) {
          commit(job, static_cast<int64_t>(next), &scratch);
          state.store(epoch << 2 | kDone, std::memory_order_release);
        }
      }
      active_.fetch_sub(1, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void loop() {
    std::vector<float> scratch;
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinUs);
      uint64_t epoch = seen;
      for (int64_t i = 0; epoch == seen; ++i) {
        epoch = ticket_.load(std::memory_order_acquire) >> 32;
        if (epoch != seen) break;
        cpu_relax();
        if (i % 64 == 63 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(m_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lock, [&] { return (ticket_.load(std::memory_order_seq_cst) >> 32) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
          epoch = ticket_.load(std::memory_order_acquire) >> 32;
        }
      }
      seen = epoch;
      work(epoch, scratch);
    }
  }

  static constexpr int64_t kSpinUs = 2000;   // a decode step's gaps between matmuls are far shorter

  const int threads_;
  const pid_t pid_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> ticket_{0};           // epoch (32 bits) | chunks n (16) | next unclaimed (16)
  std::atomic<uint64_t> state_[kMaxChunks];   // per chunk: epoch << 2 | kComputing .. kDone
  Slot slots_[2];                             // the jobs of even and odd epochs
  std::atomic<int64_t> active_{0};            // workers inside a chunk
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<int> sleepers_{0};
};

// Where a chunk of output columns [begin, begin + cols) of a (T, N) output goes: in place, or,
// for a worker, into its scratch (T, cols), which publish() then copies out.
struct Dest {
  float* o;
  int64_t ld;
};

inline Dest destination(float* out, int64_t N, int64_t T, int64_t begin, int64_t cols, std::vector<float>* scratch) {
  if (scratch == nullptr) return {out + begin, N};
  scratch->resize(T * cols);
  return {scratch->data(), cols};
}

inline void publish(float* out, int64_t N, int64_t T, int64_t begin, int64_t cols, const std::vector<float>& scratch) {
  for (int64_t t = 0; t < T; ++t) std::memcpy(out + t * N + begin, scratch.data() + t * cols, cols * sizeof(float));
}

// The chunks of a matmul of `rows` activation rows: a gemv's few rows on the Pool (its workers,
// spinning between calls, take a chunk within a microsecond; a decode step is ~120 calls of tens
// of microseconds), more rows on OpenMP's threads, each claiming chunks from one atomic counter.
// Past a few rows the compiled forward's other loops (attention, norms, rope) run on OpenMP too,
// and two thread pools that each spin after their work took each other's cores: a 64-row forward
// of a 135M q8_0 model took 127 ms with every matmul on the Pool, 51 ms with these on OpenMP
// (OMP_WAIT_POLICY=passive gave 42 ms, but slowed float32's oneDNN forward by 20%). The caller
// runs every chunk itself inside a parallel region.
constexpr int64_t kOpenMPRows = 8;

template <typename Job>
void run(int64_t chunks, const Job& job, int64_t rows) {
  if (rows < kOpenMPRows) {
    Pool::get().run(chunks, job);
    return;
  }
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  std::atomic<int64_t> next{0};
  auto claim = [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) job.compute(c, nullptr, Live{nullptr, 0});
  };
  if (threads <= 1 || at::in_parallel_region())
    claim(0, 1);
  else
    at::parallel_for(0, threads, 1, claim);
}

}  // namespace work
