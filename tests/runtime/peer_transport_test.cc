// The job's peer transport (GrpcPeerTransport) over the direct transport on
// loopback: how many connections it opens to a peer follows its
// configuration, which the link prober's latency rounds set to one.
#include "worker/runtime/peer_transport.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "tests/transport/recording_sink.h"
#include "worker/transport/activation_server.h"
#include "worker/transport/direct_server.h"
#include "worker/transport/tcp_tuning.h"

namespace detour {
namespace {

class PeerTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ActivationServerOptions o;
    o.max_tensor_bytes = 1 << 20;
    activations_ = std::make_unique<ActivationServer>(&sink_, o);
    DirectServerOptions d;
    d.listen = HostPort{"127.0.0.1", 0};
    auto started = DirectServer::Start(activations_.get(), d);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
  }

  // Sends one small tensor to "w2" over a transport of `config`, whose peer
  // is said to be a long fat link away.
  absl::Status SendOne(const PeerTransportConfig& config) {
    std::unique_ptr<PeerTransport> transport = GrpcPeerTransport::Factory()(config);
    PeerEndpoint peer;
    peer.worker_id = "w2";
    peer.address = "127.0.0.1:1";  // unused: tensors take the direct address
    peer.data_address = absl::StrCat("127.0.0.1:", server_->port());
    peer.link = kLongFatLink;
    transport->SetPeers({peer});
    v1::FrameHeader h;
    h.set_job_id("job-1");
    h.set_direction(v1::DIRECTION_FORWARD);
    h.set_sender("w1");
    h.add_shape(16);
    h.set_dtype(v1::DTYPE_FP32);
    auto bytes = std::make_shared<std::vector<char>>(64, 1);
    TensorView view;
    view.data = bytes->data();
    view.bytes = bytes->size();
    view.keepalive = bytes;
    absl::Notification done;
    absl::Status result;
    transport->Send("w2", h, view, [&](absl::Status s, double) {
      result = s;
      done.Notify();
    });
    done.WaitForNotificationWithTimeout(absl::Seconds(20));
    transport->Close();
    return done.HasBeenNotified() ? result : absl::DeadlineExceededError("no answer");
  }

  static constexpr LinkHint kLongFatLink{10e9, absl::Milliseconds(300)};
  RecordingSink sink_;
  std::unique_ptr<ActivationServer> activations_;
  std::unique_ptr<DirectServer> server_;
};

// By default the connections follow the link (PlanStripes: many for 10 GB/s
// over 300 ms); asked for one, the transport opens one.
TEST_F(PeerTransportTest, OpensTheDirectConnectionsItsConfigurationAsksFor) {
  const int planned = PlanStripes(kLongFatLink, ReadTcpLimits()).connections;
  ASSERT_GT(planned, 1) << "this machine's socket limits need no stripes for 3 GB in flight";
  PeerTransportConfig config;
  ASSERT_TRUE(SendOne(config).ok());
  EXPECT_EQ(server_->stats().accepted, static_cast<uint64_t>(planned));
  config.direct_connections = 1;
  ASSERT_TRUE(SendOne(config).ok());
  EXPECT_EQ(server_->stats().accepted, static_cast<uint64_t>(planned) + 1);
  EXPECT_EQ(sink_.received().size(), 2u);
}

}  // namespace
}  // namespace detour
