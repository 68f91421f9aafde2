#include "worker/runtime/peer_transport.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/region_links.h"

namespace detour {

LinkEmulation EmulationBetween(const v1::ClusterSpec& net, const std::string& from_region,
                               const std::string& to_region) {
  LinkEmulation e;
  if (net.nodes().empty() && net.links().empty()) return e;
  // The intra-region figures (1 ms and 5 GB/s where unset) also stand for
  // two regions with no listed link.
  double latency_ms = net.intra_region_latency_ms() > 0 ? net.intra_region_latency_ms() : 1.0;
  double gbps = net.intra_region_bandwidth_gbytes_per_s() > 0
                    ? net.intra_region_bandwidth_gbytes_per_s()
                    : 5.0;
  if (from_region != to_region) {
    if (auto link = RegionLinks(net).Between(from_region, to_region)) {
      latency_ms = link->latency_ms;
      gbps = link->bandwidth_gbytes_per_s;
    }
  }
  e.latency = absl::Milliseconds(latency_ms);
  e.bandwidth_bytes_per_s = gbps * 1e9;
  return e;
}

GrpcPeerTransport::GrpcPeerTransport(PeerTransportConfig config) : config_(std::move(config)) {}

GrpcPeerTransport::~GrpcPeerTransport() { Close(); }

void GrpcPeerTransport::SetPeers(const std::vector<PeerEndpoint>& peers) {
  std::vector<std::unique_ptr<PeerSender>> closing;
  {
    absl::MutexLock lock(&mu_);
    std::map<std::string, PeerEndpoint> next;
    for (const PeerEndpoint& p : peers) next[p.worker_id] = p;
    for (auto it = senders_.begin(); it != senders_.end();) {
      auto keep = next.find(it->first);
      if (keep == next.end() || keep->second.address != peers_[it->first].address ||
          keep->second.data_address != peers_[it->first].data_address) {
        closing.push_back(std::move(it->second));
        it = senders_.erase(it);
      } else {
        ++it;
      }
    }
    peers_ = std::move(next);
  }
  for (auto& sender : closing) sender->Close();
}

void GrpcPeerTransport::Send(const std::string& to, v1::FrameHeader header, TensorView data,
                             Done done) {
  PeerSender* sender = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) {
      done(absl::CancelledError("the job's transport is closed"), 0);
      return;
    }
    sender = SenderLocked(to);
    if (sender == nullptr) {
      done(absl::NotFoundError(absl::StrCat("no peer ", to, " in the job")), 0);
      return;
    }
    // Queued under the lock: Close cannot destroy the sender meanwhile.
    sender->Send(std::move(header), std::move(data), std::move(done));
  }
}

void GrpcPeerTransport::Prepare(const std::vector<std::string>& peers) {
  absl::MutexLock lock(&mu_);
  if (closed_) return;
  for (const std::string& to : peers) {
    if (PeerSender* sender = SenderLocked(to)) sender->Connect();
  }
}

PeerSender* GrpcPeerTransport::SenderLocked(const std::string& to) {
  auto peer = peers_.find(to);
  if (peer == peers_.end()) return nullptr;
  auto& slot = senders_[to];
  if (slot == nullptr) {
    PeerSenderOptions o;
    o.emulation = EmulationBetween(config_.emulate_network, config_.region, peer->second.region);
    o.security = config_.security;
    o.peer_name = peer->second.worker_id;
    o.direct_address = peer->second.data_address;
    o.link = peer->second.link;
    o.ack_timeout = config_.ack_timeout;
    o.connect_timeout = config_.connect_timeout;
    o.direct_connections = config_.direct_connections;
    slot = std::make_unique<PeerSender>(peer->second.address, o);
  }
  return slot.get();
}

void GrpcPeerTransport::Close() {
  std::map<std::string, std::unique_ptr<PeerSender>> senders;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    senders.swap(senders_);
    peers_.clear();
  }
  for (auto& [id, sender] : senders) sender->Close();
}

PeerTransportFactory GrpcPeerTransport::Factory() {
  return [](const PeerTransportConfig& config) -> std::unique_ptr<PeerTransport> {
    return std::make_unique<GrpcPeerTransport>(config);
  };
}

}  // namespace detour
