// Thread-safety annotations, checked at compile time by clang, and the annotated mutex they
// need.
//
// Clang's thread-safety analysis (-Wthread-safety) proves, function by function, that every
// access to a member declared GUARDED_BY(mu_) happens with mu_ held, that a function declared
// REQUIRES(mu_) is only called with it held and one declared EXCLUDES(mu_) only without it. The
// macros below expand to clang's attributes under clang and to nothing elsewhere (GCC builds
// see plain code). libstdc++'s std::mutex carries no annotations, so annotated state is guarded
// by tessera::Mutex instead: a std::mutex that tells the analysis when it is held (SharedMutex,
// with ReaderLock and WriterLock, for state read by many threads and rarely written).
//
//   class Queue {
//    public:
//     void Push(int value) EXCLUDES(mu_) {
//       MutexLock lock(&mu_);
//       values_.push_back(value);
//       changed_.NotifyAll();
//     }
//     int Pop() EXCLUDES(mu_) {
//       MutexLock lock(&mu_);
//       while (values_.empty()) changed_.Wait(&mu_);  // loop: wake-ups may be spurious
//       ...
//     }
//    private:
//     Mutex mu_;
//     CondVar changed_;
//     std::vector<int> values_ GUARDED_BY(mu_);
//   };
//
// The analysis sees each function alone: a lambda that reads guarded state is not known to run
// under the lock its caller holds; write such waits as loops around CondVar::Wait. Functions it
// cannot follow (locks taken in one function and released in another through opaque handles)
// carry NO_THREAD_SAFETY_ANALYSIS with a comment saying why.
//
// Thread safety: Mutex and CondVar are for use from any thread, like std::mutex and
// std::condition_variable; a MutexLock belongs to the thread that made it.
// Invariants: a MutexLock holds its mutex from construction to destruction, except between its
// own Unlock() and Lock(); CondVar::Wait* return with the mutex held again.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#if defined(__clang__)
#define TESSERA_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define TESSERA_THREAD_ANNOTATION(x)
#endif

// A type whose objects are locks ("mutex" in messages).
#define CAPABILITY(x) TESSERA_THREAD_ANNOTATION(capability(x))
// An RAII type that holds a capability for its lifetime (MutexLock).
#define SCOPED_CAPABILITY TESSERA_THREAD_ANNOTATION(scoped_lockable)
// The member is read and written only with `x` held.
#define GUARDED_BY(x) TESSERA_THREAD_ANNOTATION(guarded_by(x))
// What the (smart) pointer member points to is accessed only with `x` held.
#define PT_GUARDED_BY(x) TESSERA_THREAD_ANNOTATION(pt_guarded_by(x))
// Lock ordering: this mutex is taken before / after the named ones.
#define ACQUIRED_BEFORE(...) TESSERA_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) TESSERA_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
// The caller must hold the capabilities (exclusively / shared).
#define REQUIRES(...) TESSERA_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) TESSERA_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))
// The function acquires / releases the capabilities (no argument: `this`).
#define ACQUIRE(...) TESSERA_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) TESSERA_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE(...) TESSERA_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) TESSERA_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
// The function acquires the capability when it returns `result` (TryLock).
#define TRY_ACQUIRE(...) TESSERA_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
// The caller must not hold the capabilities (the function takes them itself).
#define EXCLUDES(...) TESSERA_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
// The function checks at run time that the capability is held; the analysis then assumes it.
#define ASSERT_CAPABILITY(x) TESSERA_THREAD_ANNOTATION(assert_capability(x))
// The function returns a reference to the named capability.
#define RETURN_CAPABILITY(x) TESSERA_THREAD_ANNOTATION(lock_returned(x))
// Turns the analysis off for one function; say why next to it.
#define NO_THREAD_SAFETY_ANALYSIS TESSERA_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace tessera {

// A std::mutex the analysis knows about. Not recursive.
class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mutex_.lock(); }
  void Unlock() RELEASE() { mutex_.unlock(); }
  // True when it took the mutex.
  bool TryLock() TRY_ACQUIRE(true) { return mutex_.try_lock(); }
  // Tells the analysis that the caller holds the mutex (checked by nothing at run time): for
  // code it cannot follow, e.g. a callback that its caller runs under the lock.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mutex_;
};

// A std::shared_mutex the analysis knows about: many readers or one writer.
class CAPABILITY("mutex") SharedMutex {
 public:
  SharedMutex() = default;
  SharedMutex(const SharedMutex&) = delete;
  SharedMutex& operator=(const SharedMutex&) = delete;

  void Lock() ACQUIRE() { mutex_.lock(); }
  void Unlock() RELEASE() { mutex_.unlock(); }
  void LockShared() ACQUIRE_SHARED() { mutex_.lock_shared(); }
  void UnlockShared() RELEASE_SHARED() { mutex_.unlock_shared(); }

 private:
  std::shared_mutex mutex_;
};

// Holds a SharedMutex shared (std::shared_lock, annotated) for its lifetime.
class SCOPED_CAPABILITY ReaderLock {
 public:
  explicit ReaderLock(SharedMutex* mutex) ACQUIRE_SHARED(mutex) : mutex_(mutex) {
    mutex_->LockShared();
  }
  ~ReaderLock() RELEASE() { mutex_->UnlockShared(); }
  ReaderLock(const ReaderLock&) = delete;
  ReaderLock& operator=(const ReaderLock&) = delete;

 private:
  SharedMutex* const mutex_;
};

// Holds a SharedMutex exclusively (std::unique_lock, annotated) for its lifetime.
class SCOPED_CAPABILITY WriterLock {
 public:
  explicit WriterLock(SharedMutex* mutex) ACQUIRE(mutex) : mutex_(mutex) { mutex_->Lock(); }
  ~WriterLock() RELEASE() { mutex_->Unlock(); }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

 private:
  SharedMutex* const mutex_;
};

// Holds a Mutex from construction to destruction (std::lock_guard, annotated). Unlock() and
// Lock() drop and retake it inside the scope; the destructor releases it only when held.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mutex) ACQUIRE(mutex) : mutex_(mutex) { mutex_->Lock(); }
  ~MutexLock() RELEASE() {
    if (held_) mutex_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  // REQUIRES: held (not unlocked already).
  void Unlock() RELEASE() {
    held_ = false;
    mutex_->Unlock();
  }
  // REQUIRES: not held (after Unlock()).
  void Lock() ACQUIRE() {
    mutex_->Lock();
    held_ = true;
  }

 private:
  Mutex* const mutex_;
  bool held_ = true;
};

// A condition variable that waits on a Mutex (std::condition_variable, annotated). Every wait
// may wake spuriously: call it in a loop that rechecks the condition.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Releases *mutex, blocks until notified, takes *mutex again.
  void Wait(Mutex* mutex) REQUIRES(mutex) {
    std::unique_lock<std::mutex> lock(mutex->mutex_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held: the caller's MutexLock owns it
  }
  // As Wait, giving up at `deadline`. Returns false when it returned because the deadline
  // passed, true when notified (or woken spuriously).
  template <typename Clock, typename Duration>
  bool WaitUntil(Mutex* mutex, const std::chrono::time_point<Clock, Duration>& deadline)
      REQUIRES(mutex) {
    std::unique_lock<std::mutex> lock(mutex->mutex_, std::adopt_lock);
    const std::cv_status status = cv_.wait_until(lock, deadline);
    lock.release();
    return status == std::cv_status::no_timeout;
  }
  // As Wait, giving up after `timeout`; returns as WaitUntil.
  template <typename Rep, typename Period>
  bool WaitFor(Mutex* mutex, const std::chrono::duration<Rep, Period>& timeout) REQUIRES(mutex) {
    return WaitUntil(mutex, std::chrono::steady_clock::now() + timeout);
  }

  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace tessera
