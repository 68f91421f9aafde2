// Tensor transfers over the direct transport between two processes, for the
// WAN test bed (benchmarks/wan/transfer.sh runs one end in each of two
// namespaces joined by detour-wanem). The receiver accepts every tensor into
// one reused buffer; the sender measures, per tensor size:
//   - open: the first 64-byte tensor, connections opened for it included;
//   - round trip: the smallest of a few 64-byte tensors, sent to acknowledged;
//   - first: the first tensor of the size, on connections just opened;
//   - isolated: tensors sent one at a time, each after the last was
//     acknowledged and a pause (--idle_ms), as a pipeline stage sends one
//     activation per microbatch;
//   - stream: --count tensors queued at once, as a stage with several
//     microbatches ready sends them; --stream_runs times, reported as the
//     median run and the slowest (under random loss the runs differ a lot:
//     a best-of would flatter the link);
//   - isolated warm: isolated again after the streams, on connections
//     whose windows the streams opened.
// A rate is bytes / (time - round trip): the acknowledgement's trip back and
// the first byte's trip there are latency, not bandwidth. Output: one line
// per measurement, `key=value` fields, so scripts can pick them out.
//
//   wan_transfer serve --listen 10.77.0.2:7700 [--certs DIR]
//   wan_transfer send --to 10.77.0.2:7700 --mib 16 [--count 4] [--certs DIR]
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "benchmarks/common/bench_transport.h"
#include "common/flags.h"
#include "common/net/address.h"
#include "common/net/tls.h"
#include "worker/transport/activation_server.h"
#include "worker/transport/direct_server.h"
#include "worker/transport/peer_sender.h"
#include "worker/transport/tcp_tuning.h"

namespace detour {
namespace {

absl::StatusOr<TransportSecurity> Security(const std::string& certs) {
  if (certs.empty()) return TransportSecurity::Insecure();
  return LoadBenchTls(certs);
}

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

int Serve(const std::string& listen, const std::string& certs) {
  auto address = ParseHostPort(listen, "--listen", /*allow_port_zero=*/false);
  if (!address.ok()) {
    std::fprintf(stderr, "wan_transfer: %s\n", address.status().ToString().c_str());
    return 2;
  }
  auto security = Security(certs);
  if (!security.ok()) {
    std::fprintf(stderr, "wan_transfer: %s\n", security.status().ToString().c_str());
    return 1;
  }
  ReusingSink sink;
  ActivationServerOptions server_options;
  server_options.require_peer_certificates = !certs.empty();
  ActivationServer server(&sink, server_options);
  DirectServerOptions options;
  options.listen = *address;
  options.security = *security;
  auto direct = DirectServer::Start(&server, options);
  if (!direct.ok()) {
    std::fprintf(stderr, "wan_transfer: %s\n", direct.status().ToString().c_str());
    return 1;
  }
  std::printf("listening port=%d tls=%d\n", (*direct)->port(), certs.empty() ? 0 : 1);
  std::fflush(stdout);
  ::signal(SIGTERM, OnSignal);
  ::signal(SIGINT, OnSignal);
  while (!g_stop) absl::SleepFor(absl::Milliseconds(100));
  (*direct)->Shutdown();
  return 0;
}

class Sender {
 public:
  explicit Sender(PeerSenderOptions options)
      : sender_(options.direct_address, std::move(options)) {}

  // Queues `n` tensors of `bytes` and waits for all acknowledgements;
  // seconds from the first queued to the last acknowledged, or -1.
  double Send(size_t bytes, int n) {
    if (data_ == nullptr || data_->size() < bytes) {
      data_ = std::make_shared<std::vector<char>>(bytes, 'x');
    }
    absl::Mutex mu;
    int left = n;
    bool ok = true;
    const absl::Time start = absl::Now();
    for (int i = 0; i < n; ++i) {
      v1::FrameHeader h;
      h.set_job_id("transfer");
      h.set_iteration(0);
      h.set_microbatch(next_id_++);
      h.set_direction(v1::DIRECTION_FORWARD);
      h.set_sender(kBenchPeerName);
      h.add_shape(static_cast<int64_t>(bytes / 4));
      h.set_dtype(v1::DTYPE_FP32);
      TensorView view;
      view.data = data_->data();
      view.bytes = bytes;
      view.keepalive = data_;
      sender_.Send(std::move(h), std::move(view), [&](absl::Status s, double) {
        absl::MutexLock lock(&mu);
        if (!s.ok()) {
          ok = false;
          std::fprintf(stderr, "wan_transfer: %s\n", s.ToString().c_str());
        }
        --left;
      });
    }
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](int* l) { return *l == 0; }, &left));
    return ok ? absl::ToDoubleSeconds(absl::Now() - start) : -1;
  }
  DirectConnectionInfo info() const { return sender_.direct_info(); }

 private:
  PeerSender sender_;
  std::shared_ptr<std::vector<char>> data_;
  uint32_t next_id_ = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// MB/s (1e6) of `bytes` over `seconds` less the round trip; 0 when that
// leaves nothing.
double Rate(double bytes, double seconds, double rtt) {
  const double t = seconds - rtt;
  return t > 0 ? bytes / t / 1e6 : 0;
}

struct SendPlan {
  std::vector<int64_t> sizes_mib;
  int64_t count = 4, repeats = 4, stream_runs = 3, idle_ms = 500, connections = 0;
  double rate_mbytes = 0, rtt_ms = 0;
};

int Send(const std::string& to, const std::string& certs, const SendPlan& plan) {
  auto security = Security(certs);
  if (!security.ok()) {
    std::fprintf(stderr, "wan_transfer: %s\n", security.status().ToString().c_str());
    return 1;
  }
  PeerSenderOptions options;
  options.security = *security;
  options.peer_name = kBenchPeerName;
  options.direct_address = to;
  options.direct_connections = static_cast<int>(plan.connections);
  options.ack_timeout = absl::Seconds(120);
  options.connect_timeout = absl::Seconds(30);
  if (plan.rate_mbytes > 0) options.link.rate_bytes_per_s = plan.rate_mbytes * 1e6;
  if (plan.rtt_ms > 0) options.link.rtt = absl::Milliseconds(plan.rtt_ms);
  Sender sender(options);

  // Round trip: the connections open on the first one (reported apart as
  // `open`: what a new pair costs before its first tensor arrives).
  const double open = sender.Send(64, 1);
  if (open < 0) return 1;
  double rtt = 1e9;
  for (int i = 0; i < 5; ++i) {
    const double t = sender.Send(64, 1);
    if (t < 0) return 1;
    rtt = std::min(rtt, t);
  }
  const DirectConnectionInfo info = sender.info();
  std::printf("rtt ms=%.2f open_ms=%.1f connections=%d cc=%s sndbuf_request=%lld\n", rtt * 1e3,
              open * 1e3, info.connections, info.congestion_control.c_str(),
              static_cast<long long>(info.sndbuf_request));
  std::fflush(stdout);
  for (int64_t mib : plan.sizes_mib) {
    const double bytes = static_cast<double>(mib) * (1 << 20);
    const double first = sender.Send(static_cast<size_t>(bytes), 1);
    if (first < 0) return 1;
    // Tensors one at a time, each after a pause; empty when one failed.
    auto one_at_a_time = [&] {
      std::vector<double> times;
      for (int64_t i = 0; i < plan.repeats; ++i) {
        absl::SleepFor(absl::Milliseconds(plan.idle_ms));
        const double t = sender.Send(static_cast<size_t>(bytes), 1);
        if (t < 0) return std::vector<double>();
        times.push_back(t);
      }
      return times;
    };
    const std::vector<double> isolated = one_at_a_time();
    if (isolated.empty()) return 1;
    std::vector<double> stream;
    for (int64_t i = 0; i < plan.stream_runs; ++i) {
      const double t = sender.Send(static_cast<size_t>(bytes), static_cast<int>(plan.count));
      if (t < 0) return 1;
      stream.push_back(t);
    }
    // The same isolated transfers once the streams have opened every
    // connection's window: what a stage sees after its first iterations
    // (`isolated` above is right after the first tensor, as in a job's
    // first iterations).
    const std::vector<double> warm = one_at_a_time();
    if (warm.empty()) return 1;
    const double iso = Median(isolated);
    const double iso_warm = Median(warm);
    const double median_stream = Median(stream);
    const double slowest_stream = *std::max_element(stream.begin(), stream.end());
    const double stream_bytes = bytes * static_cast<double>(plan.count);
    std::printf(
        "size mib=%lld first_s=%.3f first_mbps=%.1f isolated_s=%.3f isolated_mbps=%.1f "
        "stream_count=%lld stream_runs=%lld stream_s=%.3f stream_mbps=%.1f "
        "stream_worst_mbps=%.1f isolated_warm_s=%.3f isolated_warm_mbps=%.1f\n",
        static_cast<long long>(mib), first, Rate(bytes, first, rtt), iso, Rate(bytes, iso, rtt),
        static_cast<long long>(plan.count), static_cast<long long>(plan.stream_runs), median_stream,
        Rate(stream_bytes, median_stream, rtt), Rate(stream_bytes, slowest_stream, rtt), iso_warm,
        Rate(bytes, iso_warm, rtt));
    std::fflush(stdout);
  }
  return 0;
}

int Main(int argc, char** argv) {
  FlagSet flags("wan_transfer",
                "Tensor transfers over the direct transport between two processes "
                "(serve | send).");
  std::string listen, to, certs, sizes = "16,64";
  SendPlan plan;
  flags.String("listen", &listen, "serve: host:port to accept direct connections on");
  flags.String("to", &to, "send: the receiver's host:port");
  flags.String("certs", &certs,
               "directory with ca.crt, bench.crt, bench.key (tools/gen_certs.sh DIR --worker "
               "bench) for TLS; empty = plaintext");
  flags.String("mib", &sizes, "send: tensor sizes in MiB, comma-separated, each in [1, 512]");
  flags.Int("count", &plan.count,
            "send: tensors queued at once in the stream measurement, [1, 64]");
  flags.Int("repeats", &plan.repeats, "send: isolated transfers per size, [1, 100]");
  flags.Int("stream_runs", &plan.stream_runs,
            "send: stream measurements per size (the median and the slowest are reported), "
            "[1, 100]");
  flags.Int("idle_ms", &plan.idle_ms, "send: pause before each isolated transfer, [0, 10000]");
  flags.Int("connections", &plan.connections,
            "send: connections to stripe over; 0 = as the link hint and buffers need");
  flags.Double("rate_mbytes", &plan.rate_mbytes, "send: the link hint's rate (MB/s); 0 = unknown");
  flags.Double("rtt_ms", &plan.rtt_ms, "send: the link hint's round trip (ms); 0 = measured");
  auto rest = flags.Parse(argc, argv);
  if (!rest.ok()) return flags.Fail(rest.status());
  const auto usage = [&](const std::string& m) {
    return flags.Fail(absl::InvalidArgumentError(m));
  };
  if (rest->size() != 1) return usage("expected one command: serve or send");
  if ((*rest)[0] == "serve") {
    if (listen.empty()) return usage("serve needs --listen host:port");
    return Serve(listen, certs);
  }
  if ((*rest)[0] != "send") return usage(absl::StrCat("unknown command '", (*rest)[0], "'"));
  if (to.empty()) return usage("send needs --to host:port");
  for (absl::string_view part : absl::StrSplit(sizes, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1 || v > 512) {
      return usage(absl::StrCat("--mib: '", part, "' is not a whole number in [1, 512]"));
    }
    plan.sizes_mib.push_back(v);
  }
  if (plan.count < 1 || plan.count > 64) return usage("--count must be in [1, 64]");
  if (plan.repeats < 1 || plan.repeats > 100) return usage("--repeats must be in [1, 100]");
  if (plan.stream_runs < 1 || plan.stream_runs > 100) {
    return usage("--stream_runs must be in [1, 100]");
  }
  if (plan.idle_ms < 0 || plan.idle_ms > 10000) return usage("--idle_ms must be in [0, 10000]");
  if (plan.connections < 0 || plan.connections > kMaxDirectStripes) {
    return usage(absl::StrCat("--connections must be in [0, ", kMaxDirectStripes, "]"));
  }
  if (!(plan.rate_mbytes >= 0 && plan.rate_mbytes <= 1e5)) {
    return usage("--rate_mbytes: [0, 1e5]");
  }
  if (!(plan.rtt_ms >= 0 && plan.rtt_ms <= 60000)) return usage("--rtt_ms: [0, 60000]");
  return Send(to, certs, plan);
}

}  // namespace
}  // namespace detour

int main(int argc, char** argv) { return detour::Main(argc, argv); }
