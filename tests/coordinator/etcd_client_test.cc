// The etcd client and leader election against real etcd members
// (tests/coordinator/etcd_cluster.h); the parsing helpers without.
#include "coordinator/etcd/etcd_client.h"

#include <atomic>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "coordinator/etcd/leader_election.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/coordinator/etcd_cluster.h"
#include "tests/e2e/process.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

TEST(EtcdUrl, ParsesEndpointsAndRefusesOthers) {
  auto endpoints = ParseEtcdUrl("etcd://h1:2379,10.0.0.2:2380", "--store");
  ASSERT_TRUE(endpoints.ok()) << endpoints.status();
  EXPECT_EQ(*endpoints, (std::vector<std::string>{"h1:2379", "10.0.0.2:2380"}));
  EXPECT_THAT(ParseEtcdUrl("http://h1:2379", "--store").status().message(),
              HasSubstr("--store: \"http://h1:2379\" is not etcd://"));
  EXPECT_FALSE(ParseEtcdUrl("etcd://h1", "--store").ok());
  EXPECT_FALSE(ParseEtcdUrl("etcd://h1:2379,", "--store").ok());
  EXPECT_FALSE(ParseEtcdUrl("etcd://:2379", "--store").ok());
  std::string many = "etcd://h:1";
  for (int i = 0; i < 16; ++i) many += ",h:1";
  EXPECT_THAT(ParseEtcdUrl(many, "--store").status().message(), HasSubstr("at most 16"));
}

TEST(EtcdUrl, PrefixEnd) {
  EXPECT_EQ(EtcdPrefixEnd("/detour/"), "/detour0");
  EXPECT_EQ(EtcdPrefixEnd("a\xff"), "b");
  EXPECT_EQ(EtcdPrefixEnd("\xff"), std::string(1, '\0'));
}

// A member whose raft proposal timed out (no quorum) answers UNKNOWN with
// Go's context error: the outcome is unknown, as when this side's deadline
// passes, so the call goes on to the next member and a job store holds the
// job rather than failing it. Other UNKNOWN answers stay what they are.
TEST(EtcdClient, AMembersTimeoutAnswerIsAnUnknownOutcome) {
  EXPECT_EQ(
      EtcdAnswerStatus(grpc::Status(grpc::StatusCode::UNKNOWN, "context deadline exceeded")).code(),
      absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(EtcdAnswerStatus(grpc::Status(grpc::StatusCode::UNKNOWN, "context canceled")).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(EtcdAnswerStatus(grpc::Status(grpc::StatusCode::UNKNOWN, "something else")).code(),
            absl::StatusCode::kUnknown);
  EXPECT_EQ(EtcdAnswerStatus(
                grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "context deadline exceeded"))
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(EtcdAnswerStatus(grpc::Status::OK).ok());
}

TEST(EtcdClient, NoMemberReachableIsAnErrorNamingEachEndpoint) {
  auto [fd1, port1] = testing::OccupyPort();  // listens, never speaks gRPC
  ::close(fd1);                               // now nothing listens there
  EtcdOptions options;
  options.endpoints = {absl::StrCat("127.0.0.1:", port1)};
  options.call_timeout = absl::Seconds(2);
  auto client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  auto put = (*client)->Put("/k", "v");
  ASSERT_FALSE(put.ok());
  EXPECT_THAT(put.status().message(), HasSubstr(absl::StrCat("127.0.0.1:", port1)));
  EXPECT_THAT(put.status().message(), HasSubstr("etcd Put"));
}

class EtcdClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::FindEtcdBinary().empty()) GTEST_SKIP() << testing::kNoEtcd;
    absl::Status started = cluster_.Start(1);
    ASSERT_TRUE(started.ok()) << started;
    client_ = cluster_.Client();
  }

  testing::EtcdCluster cluster_;
  std::unique_ptr<EtcdClient> client_;
};

TEST_F(EtcdClientTest, PutGetRangeDelete) {
  ASSERT_TRUE(client_->Put("/t/a", "1").ok());
  auto second = client_->Put("/t/b", "2");
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(client_->Put("/t/c", "3").ok());
  auto b = client_->Get("/t/b");
  ASSERT_TRUE(b.ok() && b->has_value());
  EXPECT_EQ((*b)->value, "2");
  EXPECT_EQ((*b)->mod_revision, *second);
  EXPECT_FALSE(client_->Get("/t/none")->has_value());
  auto page = client_->Range("/t/", EtcdPrefixEnd("/t/"), 2);
  ASSERT_TRUE(page.ok());
  ASSERT_EQ(page->kvs.size(), 2u);
  EXPECT_EQ(page->kvs[0].key, "/t/a");
  EXPECT_TRUE(page->more);
  EXPECT_EQ(*client_->DeleteRange("/t/", EtcdPrefixEnd("/t/")), 3);
  EXPECT_TRUE(client_->Range("/t/", EtcdPrefixEnd("/t/"))->kvs.empty());
}

TEST_F(EtcdClientTest, TxnComparesRevisions) {
  auto written = client_->Put("/t/k", "old");
  ASSERT_TRUE(written.ok());
  etcdserverpb::TxnRequest stale;
  *stale.add_compare() = EtcdModRevisionIs("/t/k", *written - 1);
  *stale.add_success() = EtcdPutOp("/t/k", "lost");
  *stale.add_failure() = EtcdGetOp("/t/k");
  auto lost = client_->Txn(stale);
  ASSERT_TRUE(lost.ok()) << lost.status();
  EXPECT_FALSE(lost->succeeded());
  EXPECT_EQ(lost->responses(0).response_range().kvs(0).value(), "old");

  etcdserverpb::TxnRequest current = stale;
  current.mutable_compare(0)->set_mod_revision(*written);
  current.mutable_success(0)->mutable_request_put()->set_value("new");
  auto won = client_->Txn(current);
  ASSERT_TRUE(won.ok());
  EXPECT_TRUE(won->succeeded());
  EXPECT_EQ((*client_->Get("/t/k"))->value, "new");

  etcdserverpb::TxnRequest create;
  *create.add_compare() = EtcdCreateRevisionIs("/t/k", 0);
  *create.add_success() = EtcdPutOp("/t/k", "again");
  EXPECT_FALSE(client_->Txn(create)->succeeded());
}

TEST_F(EtcdClientTest, RequestsOverEtcdsLimitAreRefusedBeforeSending) {
  auto put = client_->Put("/t/big", std::string(1600 * 1024, 'x'));
  ASSERT_EQ(put.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(put.status().message(), HasSubstr("at most 1572864"));
  EXPECT_FALSE(client_->Get("/t/big")->has_value());
}

TEST_F(EtcdClientTest, LeasesKeepKeysAndRevokingDeletesThem) {
  auto lease = client_->LeaseGrant(absl::Seconds(10));
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->ttl, absl::Seconds(10));
  ASSERT_TRUE(client_->Put("/t/leased", "v", lease->id).ok());
  auto left = client_->LeaseKeepAliveOnce(lease->id);
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_GT(*left, absl::ZeroDuration());
  ASSERT_TRUE(client_->LeaseRevoke(lease->id).ok());
  EXPECT_FALSE(client_->Get("/t/leased")->has_value());
  EXPECT_EQ(client_->LeaseKeepAliveOnce(lease->id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(EtcdClientTest, ADeadFirstEndpointIsPassedOver) {
  auto [fd, port] = testing::OccupyPort();
  ::close(fd);
  EtcdOptions options;
  options.endpoints = {absl::StrCat("127.0.0.1:", port), cluster_.endpoints()[0]};
  options.call_timeout = absl::Seconds(5);
  auto client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  EXPECT_TRUE((*client)->Put("/t/x", "1").ok());
  EXPECT_EQ((*(*client)->Get("/t/x"))->value, "1");
}

// etcd asking for client certificates: a client with the CA and a
// certificate works; one without a certificate, or in plaintext, is refused
// with an error naming the endpoint.
TEST(EtcdTls, TheClientSpeaksTlsAndPresentsItsCertificate) {
  if (testing::FindEtcdBinary().empty()) GTEST_SKIP() << testing::kNoEtcd;
  testing::EtcdCluster cluster;
  absl::Status started = cluster.Start(1, /*tls=*/true);
  ASSERT_TRUE(started.ok()) << started;
  auto client = cluster.Client();
  ASSERT_TRUE(client->Put("/t/tls", "yes").ok());
  EXPECT_EQ((*client->Get("/t/tls"))->value, "yes");

  EtcdOptions options;
  options.endpoints = cluster.endpoints();
  options.call_timeout = absl::Seconds(2);
  TlsFiles no_certificate = cluster.tls_files();
  no_certificate.cert.clear();
  no_certificate.key.clear();
  options.security = *TransportSecurity::Load(no_certificate, /*client=*/true);
  auto anonymous = (*EtcdClient::Create(options))->Get("/t/tls");
  ASSERT_FALSE(anonymous.ok());
  EXPECT_THAT(anonymous.status().message(), HasSubstr(cluster.endpoints()[0]));
  options.security = TransportSecurity::Insecure();
  EXPECT_FALSE((*EtcdClient::Create(options))->Get("/t/tls").ok());
}

ElectionOptions Candidate(const std::string& address, std::atomic<int>* lost = nullptr) {
  ElectionOptions options;
  options.key = "/detour/leader";
  options.address = address;
  options.ttl = absl::Seconds(2);
  if (lost != nullptr) options.on_lost = [lost](const absl::Status&) { ++*lost; };
  return options;
}

TEST_F(EtcdClientTest, OneLeaderAtATimeAndTermsGrow) {
  auto other = cluster_.Client();
  LeaderElection a(client_.get(), Candidate("a:7070"));
  LeaderElection b(other.get(), Candidate("b:7070"));
  ASSERT_TRUE(*a.TryCampaign());
  EXPECT_FALSE(*b.TryCampaign());
  EXPECT_TRUE(a.IsLeader());
  EXPECT_FALSE(b.IsLeader());
  auto seen = ObserveLeader(other.get(), "/detour/leader");
  ASSERT_TRUE(seen.ok());
  EXPECT_EQ(seen->address, "a:7070");
  EXPECT_EQ(seen->term, a.term());
  ASSERT_TRUE(a.Resign().ok());
  EXPECT_FALSE(a.IsLeader());
  ASSERT_TRUE(b.Campaign(absl::Seconds(30)).ok());
  EXPECT_GT(b.term(), seen->term);
  EXPECT_EQ(ObserveLeader(client_.get(), "/detour/leader")->address, "b:7070");
}

// A leader that crashed keeps no lease alive: its key goes with the lease,
// and a candidate waiting in Campaign takes over.
TEST_F(EtcdClientTest, ACrashedLeadersLeaseRunsOutAndAnotherIsElected) {
  auto lease = client_->LeaseGrant(absl::Seconds(2));
  ASSERT_TRUE(lease.ok());
  etcdserverpb::TxnRequest take;
  *take.add_compare() = EtcdCreateRevisionIs("/detour/leader", 0);
  *take.add_success() = EtcdPutOp("/detour/leader", "crashed:7070", lease->id);
  ASSERT_TRUE(client_->Txn(take)->succeeded());
  LeaderElection b(client_.get(), Candidate("b:7070"));
  EXPECT_FALSE(*b.TryCampaign());
  ASSERT_TRUE(b.Campaign(absl::Seconds(30), absl::Milliseconds(200)).ok());
  EXPECT_TRUE(b.IsLeader());
  EXPECT_EQ(ObserveLeader(client_.get(), "/detour/leader")->address, "b:7070");
}

TEST_F(EtcdClientTest, CampaignGivesUpAtItsDeadline) {
  LeaderElection a(client_.get(), Candidate("a:7070"));
  LeaderElection b(client_.get(), Candidate("b:7070"));
  ASSERT_TRUE(*a.TryCampaign());
  auto status = b.Campaign(absl::Seconds(1), absl::Milliseconds(100));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(a.IsLeader());
}

// The leader's key deleted behind its back (an operator, or a lease lost):
// the leader notices at its next keep-alive and steps down.
TEST_F(EtcdClientTest, ALeaderWhoseKeyIsGoneStepsDown) {
  std::atomic<int> lost{0};
  LeaderElection a(client_.get(), Candidate("a:7070", &lost));
  ASSERT_TRUE(*a.TryCampaign());
  ASSERT_EQ(*client_->DeleteRange("/detour/leader", ""), 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (a.IsLeader() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(a.IsLeader());
  while (lost.load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(lost.load(), 1);
  EXPECT_EQ(a.term(), 0);
}

// Quorum lost: keep-alives fail, so the leader stops calling itself leader
// (at the latest when its lease would have run out) and says why.
TEST(EtcdElection, ALeaderCutOffFromAQuorumStepsDown) {
  if (testing::FindEtcdBinary().empty()) GTEST_SKIP() << testing::kNoEtcd;
  testing::EtcdCluster cluster;
  ASSERT_TRUE(cluster.Start(3).ok());
  auto client = cluster.Client(absl::Seconds(1));
  std::atomic<int> lost{0};
  LeaderElection a(client.get(), Candidate("a:7070", &lost));
  ASSERT_TRUE(*a.TryCampaign());
  cluster.Kill(1);
  cluster.Kill(2);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (a.IsLeader() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(a.IsLeader());
  while (lost.load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(lost.load(), 1);
}

}  // namespace
}  // namespace detour
