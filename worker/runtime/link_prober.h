// Measures this worker's links to its peers over the tensor transport when
// the coordinator asks (LinkProbe; docs/RUNTIME.md §"Measured links"), and
// answers probes peers send here.
//
// Sending: a round runs on the prober's own thread over a transport of its
// own (the job's factory and security, so probes take the path tensors
// take): `pings` small probes to every peer at once, one after another (the
// smallest round trip is the link's latency), then, one peer at a time so
// that each link is measured alone, bulk probes of 1 MiB, 2 MiB, ... sent
// one at a time, until the rate stops growing by 10%, the next size would
// pass bulk_max_bytes, or the peer's share of the round's budget is spent.
// A bulk probe's rate is its bytes over its transfer time less one round
// trip; the link's bandwidth is the best rate seen. A long fat link needs
// several round trips of growing windows before it carries its rate: the
// growing sizes follow it there, and stop once it is there.
//
// Receiving: a probe is accepted only from a peer of the newest round the
// coordinator asked this worker for (of the same job), only up to
// kMaxProbeBytes each and kMaxHeldProbeBytes in all at once; its bytes are
// dropped on arrival.
//
// Thread-safe. One round at a time: a request while one runs is kept (the
// newest only) and runs next.
#ifndef DETOUR_WORKER_RUNTIME_LINK_PROBER_H_
#define DETOUR_WORKER_RUNTIME_LINK_PROBER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/metrics.h"
#include "detour/v1/activation_service.pb.h"
#include "detour/v1/control_service.pb.h"
#include "worker/runtime/peer_transport.h"
#include "worker/transport/activation_server.h"

namespace detour {

class LinkProber {
 public:
  using SendFn = std::function<absl::Status(v1::WorkerMessage)>;

  // Largest probe tensor, and the most probe bytes held at once.
  static constexpr uint64_t kMaxProbeBytes = uint64_t{64} << 20;
  static constexpr uint64_t kMaxHeldProbeBytes = uint64_t{256} << 20;
  // Bounds on what a LinkProbe may ask for.
  static constexpr int kMaxPings = 16;
  static constexpr int kMaxPeers = 1024;
  static constexpr uint32_t kMaxBudgetMs = 600'000;
  // Bytes of one ping, and the first bulk probe's.
  static constexpr uint64_t kPingBytes = 64;
  static constexpr uint64_t kFirstBulkBytes = uint64_t{1} << 20;

  // `base`: this worker's transport configuration (region, security); a
  // round's emulation comes from its LinkProbe. `metrics` may be null.
  LinkProber(PeerTransportFactory factory, PeerTransportConfig base, SendFn send,
             metrics::Registry* metrics);
  ~LinkProber();
  LinkProber(const LinkProber&) = delete;
  LinkProber& operator=(const LinkProber&) = delete;

  void SetWorkerId(const std::string& id);

  // A LinkProbe from the coordinator: validated (an error is logged and the
  // request dropped), then run on the prober's thread.
  void OnProbe(const v1::LinkProbe& probe);

  // TensorSink for DIRECTION_PROBE tensors (gRPC threads).
  absl::StatusOr<MutableBuffer> Allocate(const v1::FrameHeader& header);

  // Ends the thread; a round in flight is cut short. Idempotent.
  void Stop();

  // Checks a LinkProbe's bounds (exposed for tests).
  static absl::Status Validate(const v1::LinkProbe& probe);

 private:
  v1::LinkReport Round(const v1::LinkProbe& probe);
  void Loop();
  void Export(const v1::LinkMeasurement& m);

  const PeerTransportFactory factory_;
  const PeerTransportConfig base_;
  const SendFn send_;

  absl::Mutex mu_;
  std::string me_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::LinkProbe> next_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Who may send probes here: the peers of the newest round, for its job.
  std::string allowed_job_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> allowed_peers_ ABSL_GUARDED_BY(mu_);
  const std::shared_ptr<std::atomic<uint64_t>> held_ = std::make_shared<std::atomic<uint64_t>>(0);

  metrics::GaugeFamily* rtt_ = nullptr;
  metrics::GaugeFamily* bandwidth_ = nullptr;
  metrics::Counter* rounds_ = nullptr;
  metrics::Counter* probe_bytes_ = nullptr;
  std::set<std::string> exported_;  // peers with series (the prober's thread)

  std::thread thread_;
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_LINK_PROBER_H_
