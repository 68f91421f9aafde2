// Building blocks for gRPC callback-API server reactors that other threads
// write to (plans to a worker's Session, job events to a Watch stream).
//
// gRPC may run a reaction inline from the call that triggered it (OnDone from
// inside Finish, OnWriteDone from inside StartWrite), so neither piece holds
// a lock while calling into gRPC, and a reactor is deleted only when gRPC is
// done with it *and* no other thread holds a reference.
#ifndef DETOUR_COMMON_NET_REACTOR_SUPPORT_H_
#define DETOUR_COMMON_NET_REACTOR_SUPPORT_H_

#include <atomic>
#include <deque>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "grpcpp/support/status.h"

namespace detour {

// One write in flight, the rest queued; a requested Finish waits for the
// write in flight. Thread-safe. The reactor calls StartWrite/Finish on what
// these methods return, outside any lock.
template <typename Msg>
class ServerOutbox {
 public:
  // What the reactor must do next.
  struct Action {
    const Msg* write = nullptr;  // StartWrite(write) when set
    bool finish = false;         // Finish(status) when set
    grpc::Status status;
  };

  // Queues `msg`. Dropped (returns an empty action) once finishing.
  Action Enqueue(Msg msg) {
    absl::MutexLock lock(&mu_);
    Action action;
    if (finishing_) return action;
    queue_.push_back(std::move(msg));
    if (!in_flight_) {
      in_flight_ = true;
      action.write = &queue_.front();
    }
    return action;
  }

  // Queues `msg` as the last message, then finishes with `status`.
  Action EnqueueLast(Msg msg, grpc::Status status) {
    Action action = Enqueue(std::move(msg));
    absl::MutexLock lock(&mu_);
    if (!finishing_) {
      finishing_ = true;
      final_status_ = std::move(status);
    }
    return action;
  }

  // From OnWriteDone. A failed write (peer gone) finishes the stream.
  Action WriteDone(bool ok) {
    absl::MutexLock lock(&mu_);
    Action action;
    queue_.pop_front();
    in_flight_ = false;
    if (!ok && !finishing_) {
      finishing_ = true;
      final_status_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed: peer gone");
    }
    if (!queue_.empty() && ok) {
      in_flight_ = true;
      action.write = &queue_.front();
      return action;
    }
    if (finishing_ && !finished_) {
      finished_ = true;
      action.finish = true;
      action.status = final_status_;
    }
    return action;
  }

  // Asks for Finish(status): immediately when nothing is in flight, else
  // after the write in flight (queued messages are dropped). Only the first
  // request counts.
  Action RequestFinish(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    Action action;
    if (finishing_) {
      if (!in_flight_ && !finished_) {
        finished_ = true;
        action.finish = true;
        action.status = final_status_;
      }
      return action;
    }
    finishing_ = true;
    final_status_ = std::move(status);
    if (in_flight_) {
      // Keep only the message being written.
      while (queue_.size() > 1) queue_.pop_back();
      return action;
    }
    finished_ = true;
    action.finish = true;
    action.status = final_status_;
    return action;
  }

  // Finishes with `status` once every queued message is written (the peer
  // half-closed: it still gets all answers). Only the first request counts.
  Action FinishAfterQueued(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    Action action;
    if (finishing_) return action;
    finishing_ = true;
    final_status_ = std::move(status);
    if (!in_flight_) {  // nothing queued either
      finished_ = true;
      action.finish = true;
      action.status = final_status_;
    }
    return action;
  }

  bool finishing() const {
    absl::MutexLock lock(&mu_);
    return finishing_;
  }
  // Messages queued, the one in flight included.
  size_t queued() const {
    absl::MutexLock lock(&mu_);
    return queue_.size();
  }

 private:
  mutable absl::Mutex mu_;
  std::deque<Msg> queue_ ABSL_GUARDED_BY(mu_);
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status final_status_ ABSL_GUARDED_BY(mu_);
};

// Reference count for a reactor: one reference belongs to gRPC until OnDone,
// others to threads using it through a ReactorHandle.
class ReactorRefs {
 public:
  void AddRef() { refs_.fetch_add(1, std::memory_order_relaxed); }
  // True when the caller dropped the last reference and must delete.
  bool Release() { return refs_.fetch_sub(1, std::memory_order_acq_rel) == 1; }

 private:
  std::atomic<int> refs_{1};
};

// A shareable way to reach a reactor that may already be done. R must have
// AddRef() and Unref() (deleting itself at zero). Thread-safe.
template <typename R>
class ReactorHandle {
 public:
  explicit ReactorHandle(R* reactor) : reactor_(reactor) {}

  // Runs fn(reactor) when it is still alive, keeping it alive meanwhile.
  // Returns false when the reactor is already done.
  template <typename Fn>
  bool With(Fn&& fn) {
    R* reactor;
    {
      absl::MutexLock lock(&mu_);
      if (reactor_ == nullptr) return false;
      reactor = reactor_;
      reactor->AddRef();
    }
    fn(reactor);
    reactor->Unref();
    return true;
  }

  // Called by the reactor in OnDone.
  void Detach() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }

 private:
  absl::Mutex mu_;
  R* reactor_ ABSL_GUARDED_BY(mu_);
};

}  // namespace detour

#endif  // DETOUR_COMMON_NET_REACTOR_SUPPORT_H_
