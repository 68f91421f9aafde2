// JobService over a real in-process gRPC server: List answers in pages that
// never outgrow a gRPC message, and detourctl follows them.
#include "coordinator/job_service.h"

#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/net/server.h"
#include "common/spec.h"
#include "detour/v1/job_service.grpc.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/process.h"
#include "tests/test_paths.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

class JobServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("jobservice");
    store_ = std::make_unique<JobStore>(dir_);
    ASSERT_TRUE(store_->Load().ok());
    service_ = std::make_unique<JobServiceImpl>(store_.get(), &open_, JobServiceImpl::Hooks{});
    GrpcServerOptions options;
    options.listen = HostPort{"127.0.0.1", 0};
    options.services = {service_.get()};
    auto running = StartGrpcServer(std::move(options), "test");
    ASSERT_TRUE(running.ok()) << running.status();
    running_ = std::move(*running);
    address_ = absl::StrCat("127.0.0.1:", running_.port);
    // A client with gRPC's default 4 MiB receive limit, as any client may be.
    stub_ =
        v1::JobService::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { running_.server->Shutdown(); }

  static v1::JobSpec Spec(const std::string& name) {
    v1::JobSpec spec;
    spec.set_name(name);
    spec.mutable_model()->set_preset("tiny");
    spec.set_iterations(10);
    return *NormalizeJobSpec(spec);
  }

  void CreateJobs(int n, const v1::JobSpec& spec) {
    for (int i = 0; i < n; ++i) ASSERT_TRUE(store_->Create(spec, absl::Now(), "stored").ok());
  }

  grpc::Status List(const v1::ListJobsRequest& request, v1::ListJobsResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    return stub_->List(&context, request, response);
  }

  // Every page of a listing; fails the test on an error.
  std::vector<v1::ListJobsResponse> AllPages(v1::ListJobsRequest request) {
    std::vector<v1::ListJobsResponse> pages;
    for (int i = 0; i < 1000; ++i) {
      v1::ListJobsResponse page;
      grpc::Status s = List(request, &page);
      EXPECT_TRUE(s.ok()) << s.error_message();
      if (!s.ok()) break;
      pages.push_back(page);
      if (page.next_page_token().empty()) break;
      request.set_page_token(page.next_page_token());
    }
    return pages;
  }

  std::string dir_;
  std::unique_ptr<JobStore> store_;
  ClientAuthorizer open_{ClientAuthorizer::Mode::kOpen, {}};
  std::unique_ptr<JobServiceImpl> service_;
  RunningServer running_;
  std::string address_;
  std::unique_ptr<v1::JobService::Stub> stub_;
};

// Regression: List answered every job in one message; after two
// jobs with 50 MB specs every List failed with RESOURCE_EXHAUSTED for good.
TEST_F(JobServiceTest, ListPagesNewestFirstWithoutRepeats) {
  CreateJobs(250, Spec("paged"));
  v1::ListJobsRequest request;
  auto pages = AllPages(request);  // default page size
  ASSERT_EQ(pages.size(), 3u);
  EXPECT_EQ(pages[0].jobs_size(), 100);
  EXPECT_EQ(pages[1].jobs_size(), 100);
  EXPECT_EQ(pages[2].jobs_size(), 50);
  EXPECT_TRUE(pages[2].next_page_token().empty());
  std::vector<std::string> ids;
  for (const auto& page : pages) {
    for (const auto& job : page.jobs()) ids.push_back(job.id());
  }
  ASSERT_EQ(ids.size(), 250u);
  EXPECT_EQ(ids.front(), "job-000250");
  EXPECT_EQ(ids.back(), "job-000001");
  EXPECT_TRUE(std::is_sorted(ids.rbegin(), ids.rend()));
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()).size(), 250u);

  // A job submitted while paging is newer than the token: not shown, and
  // nothing is shown twice.
  v1::ListJobsResponse first;
  request.set_page_size(120);
  ASSERT_TRUE(List(request, &first).ok());
  EXPECT_EQ(first.jobs_size(), 120);
  CreateJobs(1, Spec("late"));
  request.set_page_token(first.next_page_token());
  request.set_page_size(1000);
  v1::ListJobsResponse rest;
  ASSERT_TRUE(List(request, &rest).ok());
  EXPECT_EQ(rest.jobs_size(), 130);
  EXPECT_EQ(rest.jobs(0).id(), "job-000130");
  EXPECT_TRUE(rest.next_page_token().empty());

  // Sizes above the maximum count as the maximum; the state filter pages too.
  ASSERT_TRUE(store_->Cancel("job-000007", absl::Now()).ok());
  ASSERT_TRUE(store_->Cancel("job-000003", absl::Now()).ok());
  v1::ListJobsRequest cancelled;
  cancelled.set_state(v1::JOB_STATE_CANCELLED);
  cancelled.set_page_size(1);
  auto filtered = AllPages(cancelled);
  ASSERT_EQ(filtered.size(), 2u);
  EXPECT_EQ(filtered[0].jobs(0).id(), "job-000007");
  EXPECT_EQ(filtered[1].jobs(0).id(), "job-000003");
  v1::ListJobsRequest huge;
  huge.set_page_size(4000000000u);
  v1::ListJobsResponse all;
  ASSERT_TRUE(List(huge, &all).ok());
  EXPECT_EQ(all.jobs_size(), 251);
}

TEST_F(JobServiceTest, ListRefusesATokenItDidNotHandOut) {
  CreateJobs(3, Spec("t"));
  for (const std::string& token :
       std::vector<std::string>{"nonsense", "job-", "job-12x", "job-000001; DROP",
                                std::string(100, '9'), std::string("job-\0001", 6)}) {
    v1::ListJobsRequest request;
    request.set_page_token(token);
    v1::ListJobsResponse response;
    grpc::Status s = List(request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << token;
    EXPECT_THAT(s.error_message(), HasSubstr("page_token: ")) << token;
  }
  // A well-formed token past every job: an empty last page.
  v1::ListJobsRequest request;
  request.set_page_token("job-000001");
  v1::ListJobsResponse response;
  ASSERT_TRUE(List(request, &response).ok());
  EXPECT_EQ(response.jobs_size(), 0);
  EXPECT_TRUE(response.next_page_token().empty());
}

// Big (valid) jobs: pages stop by size, each answer fits a default client's
// 4 MiB, and every job is still reached.
TEST_F(JobServiceTest, ListPagesStayUnderTheMessageLimit) {
  v1::JobSpec big = Spec("big");
  big.mutable_pipeline()->set_num_stages(1);
  big.mutable_pipeline()->set_data_nodes(SpecLimits::kMaxDataNodes);
  big.mutable_pipeline()->set_microbatches_per_data_node(1);
  v1::StageNodes* group = big.mutable_pipeline()->add_assignment();
  for (uint32_t i = 0; i < SpecLimits::kMaxDataNodes; ++i) {
    std::string id = std::to_string(i);
    id.resize(240, 'n');
    group->add_nodes(id);
  }
  auto normalized = NormalizeJobSpec(big);
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  ASSERT_GT(normalized->ByteSizeLong(), 900u << 10);
  CreateJobs(8, *normalized);
  auto pages = AllPages(v1::ListJobsRequest());
  int jobs = 0;
  for (const auto& page : pages) {
    EXPECT_LT(page.ByteSizeLong(), 4u << 20);
    EXPECT_GE(page.jobs_size(), 1);
    jobs += page.jobs_size();
  }
  EXPECT_EQ(jobs, 8);
  EXPECT_GE(pages.size(), 3u);
}

// detourctl list follows the pages: one table, one JSON document, as before.
TEST_F(JobServiceTest, DetourctlListShowsEveryPage) {
  CreateJobs(250, Spec("ctl"));
  const std::string ctl = testing::BuildDir() + "/tools/detourctl/detourctl";
  auto run = [&](const std::vector<std::string>& args, const std::string& name) {
    std::vector<std::string> argv = {ctl, "--coordinator=" + address_, "--insecure"};
    argv.insert(argv.end(), args.begin(), args.end());
    ChildProcess p;
    const std::string log = dir_ + "/" + name + ".out";
    EXPECT_TRUE(p.Start(argv, log).ok());
    EXPECT_EQ(p.Wait(absl::Seconds(60)), 0) << p.Log();
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  const std::string table = run({"list"}, "table");
  std::vector<std::string> lines = absl::StrSplit(table, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 251u) << table.substr(0, 500);
  EXPECT_THAT(lines[0], HasSubstr("ID"));
  EXPECT_THAT(lines[1], HasSubstr("job-000250"));
  EXPECT_THAT(lines[250], HasSubstr("job-000001"));

  const std::string json = run({"--json", "list"}, "json");
  v1::ListJobsResponse parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &parsed).ok());
  EXPECT_EQ(parsed.jobs_size(), 250);
  EXPECT_TRUE(parsed.next_page_token().empty());
  EXPECT_THAT(json, ::testing::Not(HasSubstr("page_token")));
}

}  // namespace
}  // namespace detour
