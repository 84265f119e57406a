// RwLock: a reader-writer lock whose readers do not contend with one another, for tables
// that drafts on several threads read while one writer changes them now and then.
//
// Each reader thread counts itself in a slot of its own (one cache line per slot, a thread
// keeps its slot for life), so two threads drafting in parallel never write the same cache
// line; they only read the writer flag. A writer raises the flag, waits for every slot to
// drain (readers in flight finish; new ones wait), works, and lowers it. Writers are
// preferred while they hold the flag; between two exclusive sections a writer that calls
// yield_to_readers() lets the readers that queued behind it in first, so a writer applying
// a change set chunk by chunk delays each draft by at most one chunk.
//
// Meets SharedMutex: use it with std::shared_lock and std::unique_lock. Not recursive.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>

namespace ngc {

class RwLock {
 public:
  RwLock() = default;
  RwLock(const RwLock&) = delete;
  RwLock& operator=(const RwLock&) = delete;

  void lock_shared() {
    Slot& s = slots_[slot_index()];
    s.readers.fetch_add(1, std::memory_order_seq_cst);
    if (!writer_.load(std::memory_order_seq_cst)) return;  // the common case
    s.readers.fetch_sub(1, std::memory_order_seq_cst);
    waiting_.fetch_add(1, std::memory_order_seq_cst);
    for (;;) {
      writer_.wait(true, std::memory_order_seq_cst);
      s.readers.fetch_add(1, std::memory_order_seq_cst);
      if (!writer_.load(std::memory_order_seq_cst)) break;
      s.readers.fetch_sub(1, std::memory_order_seq_cst);
    }
    waiting_.fetch_sub(1, std::memory_order_seq_cst);
  }
  void unlock_shared() { slots_[slot_index()].readers.fetch_sub(1, std::memory_order_release); }

  void lock() {
    writer_mu_.lock();
    writer_.store(true, std::memory_order_seq_cst);
    for (Slot& s : slots_) {
      for (int spins = 0; s.readers.load(std::memory_order_seq_cst) != 0; ++spins) {
        if (spins > 64) std::this_thread::yield();
      }
    }
  }
  void unlock() {
    writer_.store(false, std::memory_order_seq_cst);
    writer_.notify_all();
    writer_mu_.unlock();
  }

  // Called by a writer between two exclusive sections (not holding the lock): returns once
  // the readers that were waiting for it are in.
  void yield_to_readers() {
    for (int spins = 0; waiting_.load(std::memory_order_seq_cst) != 0 && spins < 100000; ++spins)
      std::this_thread::yield();
  }

 private:
  static constexpr int kSlots = 16;
  struct alignas(64) Slot {
    std::atomic<int32_t> readers{0};  // read locks held by the threads of this slot
  };
  static int slot_index() {
    static std::atomic<uint32_t> next{0};
    thread_local const int index = static_cast<int>(next.fetch_add(1, std::memory_order_relaxed) % kSlots);
    return index;
  }

  Slot slots_[kSlots];
  alignas(64) std::atomic<bool> writer_{false};  // a writer holds or is taking the lock
  std::atomic<int32_t> waiting_{0};              // readers blocked behind a writer
  std::mutex writer_mu_;                         // one writer at a time
};

}  // namespace ngc
