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
// moved on; it notices at its next row and stops. So each call owns what its workers read: the
// caller hands run() the tensors they read (Keep: weights, KV caches) and copies anything it will
// rewrite or free (activations, tables) into a fresh buffer kept the same way (owned()). The pool
// holds a call's inputs until no worker is inside it, then drops them on the caller's thread at
// its next run() (or at drain()): freeing a model or a cache right after a call is safe, with no
// quiesce before it and nobody waiting on a descheduled worker.
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

#include <ATen/ATen.h>
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

// The tensors a pooled call's workers read, held until none of them is inside the call.
using Keep = std::vector<at::Tensor>;

// `bytes` of fresh memory that `keep` owns: a call's own copy of inputs the caller will rewrite
// (activations, per-forward buffers, tables), never reused while a late worker may read it.
inline unsigned char* owned(Keep& keep, int64_t bytes) {
  keep.push_back(at::empty({std::max<int64_t>(bytes, 1)}, at::TensorOptions().dtype(at::kByte)));
  return keep.back().data_ptr<uint8_t>();
}

// bytes rounded up to whole cache lines: the offsets of several arrays carved from one owned()
inline int64_t lines(int64_t bytes) { return (bytes + 63) & ~int64_t{63}; }

class Pool {
 public:
  static constexpr int64_t kMaxChunks = 256;
  static constexpr size_t kJobBytes = 256;
  // calls held at once: the running one and those a late worker is still inside (at most
  // threads - 1 of them); with none free a call runs on the caller alone
  static constexpr uint64_t kCalls = 16;

  // The pool for the current thread count (rebuilt when it changes, and in a forked child, which
  // has none of its parent's threads). An old pool is drained, then left idle, never destroyed.
  static Pool& get() {
    const int threads = std::max(1, at::get_num_threads());
    std::lock_guard<std::mutex> lock(registry_mutex());
    Pool*& pool = current();
    if (pool == nullptr || pool->threads_ != threads || pool->pid_ != getpid()) {
      if (pool != nullptr && pool->pid_ == getpid()) pool->drain();
      pool = new Pool(threads);
    }
    return *pool;
  }

  // Waits until no worker of the current pool is inside a call and drops every call's inputs
  // (tests; memory safety never needs it).
  static void drain_current() {
    std::lock_guard<std::mutex> lock(registry_mutex());
    if (current() != nullptr && current()->pid_ == getpid()) current()->drain();
  }

  int threads() const { return threads_; }

  // For each chunk c in [0, n), exactly one of: job.compute(c, nullptr, live) writing the output
  // in place (the caller), or job.compute(c, scratch, live) into a worker's scratch followed by
  // job.commit(c, scratch) (while the caller is still inside run()). Job: trivially copyable, at
  // most kJobBytes; compute returns false if it stopped because live() turned false. Every pointer
  // the job holds points into `keep`'s tensors (or into `out`, written only by commit).
  template <typename Job>
  void run(int64_t n, const Job& job, Keep keep) {
    static_assert(std::is_trivially_copyable_v<Job> && sizeof(Job) <= kJobBytes);
    if (n <= 0) return;
    Call* call = n == 1 || workers_.empty() || n > kMaxChunks ? nullptr : next_call();
    if (call == nullptr) {                                  // on the caller alone: nobody reads late
      for (int64_t c = 0; c < n; ++c) job.compute(c, nullptr, Live{nullptr, 0});
      return;
    }
    call->keep = std::move(keep);
    std::memcpy(call->job, &job, sizeof(Job));
    call->run = [](const void* j, int64_t c, std::vector<float>* scratch, Live live) {
      return static_cast<const Job*>(j)->compute(c, scratch, live);
    };
    call->commit = [](const void* j, int64_t c, std::vector<float>* scratch) {
      static_cast<const Job*>(j)->commit(c, scratch);
    };
    for (int64_t c = 0; c < n; ++c) call->state[c].store(kComputing, std::memory_order_relaxed);
    // publishes the call: a worker reads it only after claiming a chunk from this ticket
    ticket_.store(epoch_ << 32 | static_cast<uint64_t>(n) << 16, std::memory_order_seq_cst);
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
      call->state[next].store(kDone, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
    for (int64_t c = 0; c < n; ++c) {                       // the workers': done, or taken back
      uint64_t s = call->state[c].load(std::memory_order_acquire);
      if (s == kComputing && call->state[c].compare_exchange_strong(s, kTaken, std::memory_order_acq_rel)) {
        job.compute(c, nullptr, Live{nullptr, 0});
        continue;
      }
      for (int64_t spins = 0; call->state[c].load(std::memory_order_acquire) != kDone; ++spins) {
        if (spins < 4096) cpu_relax();                      // a worker is copying its chunk out
        else std::this_thread::yield();
      }
    }
    if (call->inside.load(std::memory_order_acquire) == 0) call->keep.clear();
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

  // One call as its workers read it. Reused for a later call only once `inside` is 0: a worker
  // counts itself in before it claims a chunk (and out again if the claim fails), and a claim
  // succeeds only while the ticket still names this call, so no worker enters a finished call.
  struct Call {
    std::atomic<int64_t> inside{0};                 // workers between counting in and out
    alignas(64) unsigned char job[kJobBytes];
    bool (*run)(const void*, int64_t, std::vector<float>*, Live) = nullptr;
    void (*commit)(const void*, int64_t, std::vector<float>*) = nullptr;
    std::atomic<uint64_t> state[kMaxChunks];        // per chunk: kComputing .. kDone
    Keep keep;                                      // the inputs (written and dropped by the caller only)
  };

  explicit Pool(int threads) : threads_(threads), pid_(getpid()) {
    for (int t = 1; t < threads; ++t) workers_.emplace_back([this] { loop(); });
    for (auto& w : workers_) w.detach();
  }

  // The next call no worker is inside (its epoch in epoch_), the inputs of every finished call
  // dropped on the way; nullptr when late workers hold all of them.
  Call* next_call() {
    for (uint64_t k = 1; k <= kCalls; ++k) {
      Call& call = calls_[(epoch_ + k) % kCalls];
      if (call.inside.load(std::memory_order_seq_cst) == 0) call.keep.clear();
    }
    for (uint64_t k = 1; k <= kCalls; ++k) {
      Call& call = calls_[(epoch_ + k) % kCalls];
      if (call.inside.load(std::memory_order_seq_cst) == 0) {
        epoch_ = (epoch_ + k) & 0xffffffffu;
        return &call;
      }
    }
    return nullptr;
  }

  void drain() {
    for (Call& call : calls_) {
      for (int64_t spins = 0; call.inside.load(std::memory_order_acquire) > 0; ++spins) {
        if (spins < 4096) cpu_relax();
        else std::this_thread::yield();
      }
      call.keep.clear();
    }
  }

  // a worker: claims chunks of call `epoch` until none is left
  void work(uint64_t epoch, std::vector<float>& scratch) {
    Call& call = calls_[epoch % kCalls];
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = t & 0xffff, n = (t >> 16) & 0xffff;
      if ((t >> 32) != epoch || next >= n) return;
      call.inside.fetch_add(1, std::memory_order_seq_cst);
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        call.inside.fetch_sub(1, std::memory_order_release);
        continue;
      }
      std::atomic<uint64_t>& state = call.state[next];
      if (call.run(call.job, static_cast<int64_t>(next), &scratch, Live{&state, kComputing})) {
        uint64_t s = kComputing;
        if (state.compare_exchange_strong(s, kCommitting, std::memory_order_acq_rel)) {
          call.commit(call.job, static_cast<int64_t>(next), &scratch);
          state.store(kDone, std::memory_order_release);
        }
      }
      call.inside.fetch_sub(1, std::memory_order_release);
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

  // A worker spins this long after a call, then sleeps on the condition variable: a decode step's
  // pooled calls come microseconds apart, so it rarely sleeps inside a step, and between steps it
  // leaves the core to whoever else needs it (2 ms of spinning after each step beside a busy
  // neighbour took the caller's share of the cores).
  static constexpr int64_t kSpinUs = 50;

  const int threads_;
  const pid_t pid_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> ticket_{0};           // epoch (32 bits) | chunks n (16) | next unclaimed (16)
  uint64_t epoch_ = 0;                        // the caller's last call (ticket_'s epoch)
  Call calls_[kCalls];                        // call e lives in calls_[e % kCalls]
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
void run(int64_t chunks, const Job& job, int64_t rows, Keep keep) {
  if (rows < kOpenMPRows) {
    Pool::get().run(chunks, job, std::move(keep));
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
