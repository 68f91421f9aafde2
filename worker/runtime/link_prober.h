// Measures this worker's links to its peers over the tensor transport when
// the coordinator asks (LinkProbe; docs/RUNTIME.md §"Measured links"), and
// answers probes peers send here.
//
// Sending: a round runs on the prober's own thread over a transport of its
// own (the job's factory and security, so probes take the path tensors
// take): `pings` small probes to every peer at once, one after another (the
// smallest round trip is the link's latency; a failed ping is retried early in
// the round, since a peer refuses probes until it has the round's request
// too), then, one peer at a time so
// that each link is measured alone, single bulk probes of 1, 2 and 4 MiB
// (each after the last was acknowledged: tensors that small travel whole
// on one connection), and last one bulk_max_bytes probe, which the
// transport stripes over its connections and which opens their windows over
// a long round trip, and as soon as it is acknowledged a stream of more of
// that size (smaller on a link expected too slow for it: StreamProbeBytes),
// two queued at all times, for at least 10 round trips, 0.25 s
// and 5 probes (at most 256 MiB), which finds the windows open. A single measurement's
// rate is its bytes over its time less one round trip; the stream's is the
// bytes acknowledged after its first acknowledgement over the time from
// that one to the last; the link's bandwidth is the best rate. The stream ends early when the
// peer's share of the round's budget is spent; the shares follow each link's need (BulkShare).
//
// The newest measurements of each peer are also this worker's link hints
// (Hint): the job's transport plans its connections to that peer from them
// (tcp_tuning.h's PlanStripes).
//
// Receiving: a probe is accepted only from a peer of the newest round the
// coordinator asked this worker for, or one that round names in
// accept_from (of the same job), only up to
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
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "detour/v1/activation_service.pb.h"
#include "detour/v1/control_service.pb.h"
#include "worker/runtime/peer_transport.h"
#include "worker/transport/activation_server.h"
#include "worker/transport/tcp_tuning.h"

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
  static constexpr size_t kMaxWorkerIdBytes = 256;
  static constexpr uint32_t kMaxBudgetMs = 600'000;
  // Bytes of one ping, and the first bulk probe's.
  static constexpr uint64_t kPingBytes = 64;
  static constexpr uint64_t kFirstBulkBytes = uint64_t{1} << 20;
  // Bounds on a LinkProbe's expected links.
  static constexpr double kMaxExpectedRttS = 60;
  static constexpr double kMaxExpectedRate = 1e13;  // bytes/s
  // The smallest probe of a link's stream. One under the direct transport's
  // stripe threshold (PeerSenderOptions::stripe_threshold_bytes, 8 MiB)
  // travels whole on one connection, which carries the link where its
  // window holds the bandwidth-delay product: StreamProbeBytes keeps a
  // probe at four expected products or more, so a 2 or 4 MiB probe is
  // chosen only for a link whose product is at most 1 MiB, well within
  // what Linux's autotuning gives one connection by default (4 MiB).
  static constexpr uint64_t kSmallestStreamProbeBytes = uint64_t{2} << 20;

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

  // What this worker last measured of its link to `peer` in job `job_id`:
  // round trip and rate, zero where not measured. Rounds under in-process
  // emulation leave no hints (their delays are not the network's).
  LinkHint Hint(const std::string& job_id, const std::string& peer);

  // Ends the thread; a round in flight is cut short. Idempotent.
  void Stop();

  // Checks a LinkProbe's bounds (exposed for tests).
  static absl::Status Validate(const v1::LinkProbe& probe);

  // The links of `probe.expected()` that `limits` cap below their expected
  // rate however many connections the transport opens (PlanStripes): per
  // capped link and direction, the peer and a line naming the setting to
  // raise (TcpLimitWarnings). OnProbe logs them once per job and peer.
  static std::vector<std::pair<std::string, std::string>> CappedLinks(const v1::LinkProbe& probe,
                                                                      const TcpLimits& limits);

  // The next link's share of what is `left` of a round's budget: `rtts`
  // holds the round trips (seconds; none where unknown) of the links still
  // to measure, the next one first, and each gets in proportion to its need
  // (common/link_probe_need.h, the measure the coordinator sized the budget
  // by). What a link leaves unspent goes to those after it.
  static absl::Duration BulkShare(absl::Duration left,
                                  const std::vector<std::optional<double>>& rtts);

  // The size of a link's striped probe and of its stream's probes, chosen
  // when the striped probe is sent with `left` of the link's share still to
  // spend: `bulk_max`, halved while the striped probe and the stream's
  // fewest probes (six) would take over half of `left` at the link's
  // `expected_rate` (bytes/s), but not below kSmallestStreamProbeBytes and
  // not below four times the expected bandwidth-delay product over
  // `rtt_s` (two probes in flight then carry a link up to four times faster
  // than expected). A stream of large probes on a slow link ends with the
  // share before its acknowledgements tell its rate. `bulk_max` when the
  // rate is unknown (0) or `bulk_max` is below the smallest.
  static uint64_t StreamProbeBytes(uint64_t bulk_max, double expected_rate, double rtt_s,
                                   absl::Duration left);

 private:
  v1::LinkReport Round(const v1::LinkProbe& probe);
  void Loop();
  void Export(const v1::LinkMeasurement& m);
  void RememberHints(const v1::LinkReport& report);
  void WarnCappedLinks(const v1::LinkProbe& probe);

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
  // The newest measurements per peer, of one job (hints_job_).
  std::string hints_job_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, LinkHint> hints_ ABSL_GUARDED_BY(mu_);
  // Peers whose capped link was logged, of one job (warned_job_).
  std::string warned_job_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> warned_ ABSL_GUARDED_BY(mu_);
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
