// A deliberate data race that ThreadSanitizer must report (tools/checks.sh
// runs this and fails if it does not): a counter written without a lock by
// the ActivationServer's reactor on gRPC threads (through the sink) and by
// another thread at the same time. It proves that tests/tsan/tsan.supp and
// the annotations of absl_sync_annotations.cc do not hide a race in code
// that gRPC calls, as the old `race:grpc::` suppressions did.
#include <atomic>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/net/server.h"
#include "worker/transport/activation_server.h"
#include "worker/transport/peer_sender.h"

namespace {

long unguarded_counter = 0;  // the race: no lock, no atomic

class RacySink : public detour::TensorSink {
 public:
  absl::StatusOr<detour::MutableBuffer> Allocate(const detour::v1::FrameHeader& h) override {
    ++unguarded_counter;  // on a gRPC thread
    auto storage = std::make_shared<std::vector<char>>(h.total_bytes());
    detour::MutableBuffer b;
    b.data = storage->data();
    b.bytes = storage->size();
    b.keepalive = storage;
    return b;
  }
  void Deliver(const detour::v1::FrameHeader&, detour::MutableBuffer) override {}
};

}  // namespace

int main() {
  RacySink sink;
  detour::ActivationServer server(&sink, detour::ActivationServerOptions());
  detour::GrpcServerOptions options;
  options.listen = detour::HostPort{"127.0.0.1", 0};
  options.generic_service = &server;
  auto running = detour::StartGrpcServer(std::move(options), "canary");
  if (!running.ok()) return 2;
  std::atomic<bool> stop{false};
  std::thread other([&] {
    while (!stop.load()) ++unguarded_counter;  // at the same time, elsewhere
  });
  detour::PeerSender sender(absl::StrCat("127.0.0.1:", running->port), detour::PeerSenderOptions());
  auto bytes = std::make_shared<std::vector<char>>(64);
  for (uint32_t mb = 0; mb < 20; ++mb) {
    detour::v1::FrameHeader h;
    h.set_job_id("canary");
    h.set_iteration(1);
    h.set_microbatch(mb);
    h.set_direction(detour::v1::DIRECTION_FORWARD);
    h.set_sender("canary");
    h.add_shape(16);
    h.set_dtype(detour::v1::DTYPE_FP32);
    detour::TensorView view;
    view.data = bytes->data();
    view.bytes = bytes->size();
    view.keepalive = bytes;
    absl::Notification done;
    sender.Send(h, view, [&](absl::Status, double) { done.Notify(); });
    done.WaitForNotificationWithTimeout(absl::Seconds(30));
  }
  stop = true;
  other.join();
  sender.Close();
  running->server->Shutdown();
  std::printf("tsan_canary: done (%ld)\n", unguarded_counter);
  return 0;
}
