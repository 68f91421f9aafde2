// JobService over a real in-process gRPC server: List answers in pages that
// never outgrow a gRPC message, and detourctl follows them.
#include "coordinator/job_service.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <utility>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/net/server.h"
#include "common/spec.h"
#include "detour/v1/job_service.grpc.pb.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/time_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/process.h"
#include "tests/test_paths.h"
#include "tests/coordinator/tiny_spec.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

class JobServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StartService(0);
    address_ = absl::StrCat("127.0.0.1:", running_.port);
    // A client with gRPC's default 4 MiB receive limit, as any client may be.
    stub_ =
        v1::JobService::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (running_.server != nullptr) running_.server->Shutdown();
  }

  // The store (from dir_) and the service on `port` (0: any).
  void StartService(int port) {
    store_ = std::make_unique<JobStore>(dir_);
    ASSERT_TRUE(store_->Load().ok());
    service_ = std::make_unique<JobServiceImpl>(store_.get(), Auth(), Hooks());
    GrpcServerOptions options;
    options.listen = HostPort{"127.0.0.1", port};
    options.services = {service_.get()};
    auto running = StartGrpcServer(std::move(options), "test");
    ASSERT_TRUE(running.ok()) << running.status();
    running_ = std::move(*running);
  }

  // As a coordinator stopping: open Watch streams end with UNAVAILABLE, the
  // port closes, the store is let go.
  void StopService() {
    service_->CloseWatches();
    running_.server->Shutdown();
    running_ = RunningServer{};
    service_.reset();
    store_.reset();
  }
  virtual const ClientAuthorizer* Auth() { return &open_; }
  virtual JobServiceImpl::Hooks Hooks() { return {}; }

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

  const testing::TempDir temp_{"jobservice"};  // outlives the store and the server
  const std::string dir_ = temp_.path();
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
  CreateJobs(250, TinySpec("paged"));
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
  CreateJobs(1, TinySpec("late"));
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
  CreateJobs(3, TinySpec("t"));
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
  v1::JobSpec big = TinySpec("big");
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

// A coordinator with --auth_tokens: alice and bob submit, root is an admin.
class OwnedJobsTest : public JobServiceTest {
 protected:
  const ClientAuthorizer* Auth() override { return &tokens_; }
  JobServiceImpl::Hooks Hooks() override {
    JobServiceImpl::Hooks hooks;
    hooks.on_resume = [this](const std::string& id, const std::string&, uint32_t) {
      return store_->Get(id);
    };
    return hooks;
  }

  // Calls `method` of the stub as the holder of `token`.
  template <typename Request, typename Response, typename Method>
  grpc::Status Call(const std::string& token, Method method, const Request& request,
                    Response* response) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    context.AddMetadata("authorization", "Bearer " + token);
    return (stub_.get()->*method)(&context, request, response);
  }
  v1::Job Submit(const std::string& token, const std::string& name) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = TinySpec(name);
    v1::Job job;
    grpc::Status s = Call(token, &v1::JobService::Stub::Submit, request, &job);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }
  grpc::Status Cancel(const std::string& token, const std::string& id, v1::Job* job) {
    v1::CancelJobRequest request;
    request.set_job_id(id);
    return Call(token, &v1::JobService::Stub::Cancel, request, job);
  }
  grpc::Status Resume(const std::string& token, const std::string& id, v1::Job* job) {
    v1::ResumeJobRequest request;
    request.set_job_id(id);
    return Call(token, &v1::JobService::Stub::Resume, request, job);
  }
  static std::vector<std::string> Actions(const v1::Job& job) {
    std::vector<std::string> out;
    for (const v1::JobHistoryEvent& e : job.history()) {
      if (e.kind() == v1::JobHistoryEvent::KIND_CLIENT_ACTION) out.push_back(e.message());
    }
    return out;
  }

  static constexpr char kAlice[] = "alice-token-0123456789";
  static constexpr char kBob[] = "bob-token-0123456789";
  static constexpr char kRoot[] = "root-token-0123456789";
  ClientAuthorizer tokens_{ClientAuthorizer::Mode::kTokens,
                           *ParseTokens(absl::StrCat(kAlice, " submit alice\n", kBob,
                                                     " submit bob\n", kRoot, " admin root\n"),
                                        "tokens")};
};

// Jobs record who submitted them; only the owner or an admin may cancel or
// resume one, and every such call lands in the job's history.
TEST_F(OwnedJobsTest, OnlyTheOwnerOrAnAdminCancelsOrResumes) {
  const v1::Job job = Submit(kAlice, "mine");
  EXPECT_EQ(job.owner(), "alice");
  EXPECT_THAT(Actions(job), ::testing::ElementsAre("submitted by alice (mine)"));

  v1::Job out;
  grpc::Status s = Cancel(kBob, job.id(), &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("belongs to alice; only its owner or an admin"));
  s = Resume(kBob, job.id(), &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(store_->Get(job.id())->state(), v1::JOB_STATE_PENDING);

  ASSERT_TRUE(Cancel(kRoot, job.id(), &out).ok());
  EXPECT_EQ(out.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(out.message(), "cancelled by root");
  // Each answer holds the job's history with the action's own event.
  EXPECT_THAT(Actions(out),
              ::testing::ElementsAre("submitted by alice (mine)", "cancelled by root"));
  ASSERT_TRUE(Resume(kAlice, job.id(), &out).ok());
  EXPECT_THAT(Actions(out), ::testing::ElementsAre("submitted by alice (mine)", "cancelled by root",
                                                   "resumed by alice from "));
  EXPECT_THAT(Actions(*store_->Get(job.id())),
              ::testing::ElementsAre("submitted by alice (mine)", "cancelled by root",
                                     "resumed by alice from "));

  // The owner cancels her own.
  const v1::Job second = Submit(kAlice, "second");
  ASSERT_TRUE(Cancel(kAlice, second.id(), &out).ok()) << out.message();
  EXPECT_EQ(out.message(), "cancelled by alice");
}

TEST_F(OwnedJobsTest, ListFiltersByOwner) {
  Submit(kAlice, "a1");
  Submit(kBob, "b1");
  Submit(kAlice, "a2");
  auto names = [&](const std::string& owner) {
    v1::ListJobsRequest request;
    request.set_owner(owner);
    v1::ListJobsResponse response;
    grpc::Status s = Call(kBob, &v1::JobService::Stub::List, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    std::vector<std::string> out;
    for (const v1::Job& j : response.jobs()) out.push_back(j.spec().name());
    return out;
  };
  EXPECT_THAT(names("alice"), ::testing::ElementsAre("a2", "a1"));
  EXPECT_THAT(names("bob"), ::testing::ElementsAre("b1"));
  EXPECT_THAT(names(""), ::testing::ElementsAre("a2", "b1", "a1"));
  EXPECT_TRUE(names("carol").empty());
  v1::ListJobsRequest request;
  request.set_owner(std::string(129, 'x'));
  v1::ListJobsResponse response;
  grpc::Status s = Call(kBob, &v1::JobService::Stub::List, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("owner: 129 bytes is longer than 128"));

  // detourctl list --owner, with alice's token.
  const std::string ctl = testing::BuildDir() + "/tools/detourctl/detourctl";
  const std::string token_file = dir_ + "/alice.token";
  {
    std::ofstream out(token_file);
    out << kAlice << "\n";
  }
  ::chmod(token_file.c_str(), 0600);
  ChildProcess p;
  const std::string log = dir_ + "/owner.out";
  ASSERT_TRUE(p.Start({ctl, "--coordinator=" + address_, "--insecure", "--token_file=" + token_file,
                       "list", "--owner=bob"},
                      log)
                  .ok());
  EXPECT_EQ(p.Wait(absl::Seconds(60)), 0) << p.Log();
  std::vector<std::string> lines = absl::StrSplit(p.Log(), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << p.Log();
  EXPECT_THAT(lines[1], HasSubstr("b1"));
}

// detourctl suggests the command and the job id meant.
TEST_F(JobServiceTest, DetourctlSuggestsCommandsAndJobIds) {
  CreateJobs(3, TinySpec("near"));
  const std::string ctl = testing::BuildDir() + "/tools/detourctl/detourctl";
  auto run = [&](const std::vector<std::string>& args, const std::string& name, int* code) {
    std::vector<std::string> argv = {ctl, "--coordinator=" + address_, "--insecure"};
    argv.insert(argv.end(), args.begin(), args.end());
    ChildProcess p;
    EXPECT_TRUE(p.Start(argv, dir_ + "/" + name + ".out").ok());
    *code = p.Wait(absl::Seconds(60)).value_or(-1);
    return p.Log();
  };
  int code = 0;
  std::string out = run({"lsit"}, "command", &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_THAT(out, HasSubstr("unknown command \"lsit\" (did you mean list?)"));
  out = run({"get", "2"}, "id", &code);
  EXPECT_NE(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("no job \"2\" (did you mean job-000002?)"));
}

// detourctl list follows the pages: one table, one JSON document, as before.
TEST_F(JobServiceTest, DetourctlListShowsEveryPage) {
  CreateJobs(250, TinySpec("ctl"));
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

// Polls `done` every 20 ms for up to a minute (children on a loaded machine).
bool Eventually(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

size_t Occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// detourctl watch (as text and as JSON) and events --follow follow a job
// through two restarts of the coordinator: each reconnects (noting it on
// stderr), shows nothing twice (the second restart changes nothing, so its
// snapshot is the last event seen) and misses no event (one was added while
// the coordinator was down). Before, each exited with status 3 at the first
// stop.
TEST_F(JobServiceTest, DetourctlFollowsAJobAcrossRestarts) {
  auto created = store_->Create(TinySpec("restart"), absl::Now(), "stored");
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  auto add_event = [&](JobStore* store, const std::string& text) {
    v1::JobHistoryEvent e;
    *e.mutable_time() =
        google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(absl::Now()));
    e.set_kind(v1::JobHistoryEvent::KIND_CLIENT_ACTION);
    e.set_message(text);
    EXPECT_TRUE(store->AddEvent(id, e).ok());
  };
  add_event(store_.get(), "event A");
  const std::string ctl = testing::BuildDir() + "/tools/detourctl/detourctl";
  auto start = [&](ChildProcess* p, std::vector<std::string> args, const std::string& name) {
    args.insert(args.begin(), {ctl, "--coordinator=" + address_, "--insecure"});
    args.push_back("--reconnect_for=60s");  // a flag of the streaming commands
    ASSERT_TRUE(p->Start(args, dir_ + "/" + name + ".out").ok());
  };
  ChildProcess watch, json, events;
  start(&watch, {"watch", id}, "watch");
  start(&json, {"--json", "watch", id}, "json");
  start(&events, {"events", id, "--follow"}, "events");
  auto logs = [&] { return watch.Log() + json.Log() + events.Log(); };
  ASSERT_TRUE(Eventually([&] {
    return absl::StrContains(events.Log(), "event A") &&
           absl::StrContains(watch.Log(), id + " pending") &&
           absl::StrContains(json.Log(), "JOB_STATE_PENDING");
  })) << logs();

  const int port = running_.port;
  // Stops the coordinator, waits until every client noted a broken stream,
  // runs `while_down`, starts it again on its port.
  auto restart = [&](const std::function<void()>& while_down) {
    std::vector<size_t> notes;
    for (ChildProcess* p : {&watch, &json, &events})
      notes.push_back(Occurrences(p->Log(), "reconnecting"));
    StopService();
    ASSERT_TRUE(Eventually([&] {
      return Occurrences(watch.Log(), "reconnecting") > notes[0] &&
             Occurrences(json.Log(), "reconnecting") > notes[1] &&
             Occurrences(events.Log(), "reconnecting") > notes[2];
    })) << logs();
    while_down();
    StartService(port);
    ASSERT_EQ(running_.port, port);
  };
  restart([&] {
    JobStore offline(dir_);
    ASSERT_TRUE(offline.Load().ok());
    add_event(&offline, "event B");
  });
  if (HasFatalFailure()) return;
  ASSERT_TRUE(Eventually([&] { return absl::StrContains(events.Log(), "event B"); })) << logs();
  ASSERT_TRUE(Eventually([&] { return Occurrences(json.Log(), "event B") >= 1; })) << logs();
  restart([] {});
  if (HasFatalFailure()) return;
  add_event(store_.get(), "event C");
  ASSERT_TRUE(Eventually([&] { return absl::StrContains(events.Log(), "event C"); })) << logs();
  // The JSON watch shows C before the cancel: a snapshot taken after both
  // would carry them in one line.
  ASSERT_TRUE(Eventually([&] { return Occurrences(json.Log(), "event C") >= 1; })) << logs();
  ASSERT_TRUE(store_->Cancel(id, absl::Now()).ok());
  EXPECT_EQ(watch.Wait(absl::Seconds(60)), 1) << watch.Log();  // cancelled: not succeeded
  EXPECT_EQ(json.Wait(absl::Seconds(60)), 1) << json.Log();
  EXPECT_EQ(events.Wait(absl::Seconds(60)), 0) << events.Log();

  // Every event once, in order, and each break noted.
  const std::string history = events.Log();
  for (const char* e : {"event A", "event B", "event C"}) {
    EXPECT_EQ(Occurrences(history, e), 1u) << e << "\n" << history;
  }
  EXPECT_LT(history.find("event A"), history.find("event B"));
  EXPECT_LT(history.find("event B"), history.find("event C"));
  EXPECT_THAT(history, HasSubstr("reconnecting in"));
  // The JSON watch: a line for each change (A; A B; A B C; cancelled), none
  // for the second restart's snapshot, which repeated the last one.
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(json.Log(), '\n', absl::SkipEmpty())) {
    if (!absl::StartsWith(line, "detourctl:")) lines.emplace_back(line);
  }
  ASSERT_EQ(lines.size(), 4u) << json.Log();
  EXPECT_THAT(lines[3], HasSubstr("JOB_STATE_CANCELLED"));
  // The text watch: the pending line once (nothing it shows changed), then
  // the end.
  EXPECT_EQ(Occurrences(watch.Log(), id + " pending"), 1u) << watch.Log();
  EXPECT_THAT(watch.Log(), HasSubstr(id + " ended: cancelled"));
  EXPECT_THAT(watch.Log(), HasSubstr("stream from coordinator " + address_ + " broke"));
}

// events --follow shows each new event once the record is full (it keeps
// the newest JobStore::kMaxHistory): it used to count the events shown, and
// with the count stuck at the limit showed nothing new.
TEST_F(JobServiceTest, DetourctlEventsFollowPastTheRecordsLimit) {
  auto created = store_->Create(TinySpec("full"), absl::Now(), "stored");
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  auto add_event = [&](const std::string& text) {
    v1::JobHistoryEvent e;
    *e.mutable_time() =
        google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(absl::Now()));
    e.set_message(text);
    EXPECT_TRUE(store_->AddEvent(id, e).ok());
  };
  for (int i = 0; i < JobStore::kMaxHistory + 5; ++i) add_event(absl::StrCat("old ", i, ";"));
  ChildProcess events;
  ASSERT_TRUE(events
                  .Start({testing::BuildDir() + "/tools/detourctl/detourctl",
                          "--coordinator=" + address_, "--insecure", "events", id, "--follow"},
                         dir_ + "/events.out")
                  .ok());
  const std::string last_old = absl::StrCat("old ", JobStore::kMaxHistory + 4, ";");
  ASSERT_TRUE(Eventually([&] { return absl::StrContains(events.Log(), last_old); }))
      << events.Log();
  add_event("new 1;");
  add_event("new 2;");
  ASSERT_TRUE(Eventually([&] { return absl::StrContains(events.Log(), "new 2;"); }))
      << events.Log();
  ASSERT_TRUE(store_->Cancel(id, absl::Now()).ok());
  EXPECT_EQ(events.Wait(absl::Seconds(60)), 0) << events.Log();
  const std::string log = events.Log();
  EXPECT_EQ(Occurrences(log, "new 1;"), 1u) << log;
  EXPECT_EQ(Occurrences(log, "new 2;"), 1u) << log;
  EXPECT_EQ(Occurrences(log, last_old), 1u) << log;
  EXPECT_EQ(Occurrences(log, "old 4;"), 0u) << log;  // rolled out before the start
}

// health --target names the server it asked, as a target (not as the
// coordinator), in its answer and its errors, and asks it even when the
// coordinators given with --coordinator are all down.
TEST_F(JobServiceTest, DetourctlHealthNamesTheTarget) {
  const std::string ctl = testing::BuildDir() + "/tools/detourctl/detourctl";
  auto [fd, closed_port] = testing::OccupyPort();
  ::close(fd);  // nothing listens there now
  const std::string closed = absl::StrCat("127.0.0.1:", closed_port);
  auto run = [&](const std::vector<std::string>& args, const std::string& name) {
    std::vector<std::string> argv = {ctl, "--insecure"};
    argv.insert(argv.end(), args.begin(), args.end());
    ChildProcess p;
    EXPECT_TRUE(p.Start(argv, dir_ + "/" + name + ".out").ok());
    const int code = p.Wait(absl::Seconds(60)).value_or(-1);
    return std::make_pair(code, p.Log());
  };
  std::pair<int, std::string> r = run(
      {"--coordinator=" + closed + ",127.0.0.1:1", "health", "--target=" + address_}, "serving");
  EXPECT_EQ(r.first, 0) << r.second;
  EXPECT_THAT(r.second, HasSubstr(address_ + ": SERVING"));
  r = run({"--coordinator=" + address_, "health", "--target=" + closed}, "down");
  EXPECT_EQ(r.first, 3) << r.second;
  EXPECT_THAT(r.second, HasSubstr("health: target " + closed + " unreachable"));
  EXPECT_THAT(r.second, ::testing::Not(HasSubstr("coordinator " + closed)));
  r = run({"--coordinator=" + closed, "health", "--target=" + address_, "--service=nope"},
          "unknown");
  EXPECT_EQ(r.first, 1) << r.second;
  EXPECT_THAT(r.second, HasSubstr("health: target " + address_ + ": NOT_FOUND"));
}

// A TLS client against a plaintext coordinator: detourctl's own error and
// hint, and none of gRPC core's raw lines ("E1204 ...
// ssl_transport_security.cc:1501] Handshake failed") before them, unless
// $GRPC_VERBOSITY asks for gRPC's, which then come in our log format.
TEST_F(JobServiceTest, DetourctlShowsItsOwnErrorsNotGrpcCoresLines) {
  const std::string certs = dir_ + "/certs";
  ChildProcess gen;
  ASSERT_TRUE(gen.Start({testing::SourceDir() + "/tools/gen_certs.sh", certs, "--client", "alice"},
                        dir_ + "/gen_certs.log")
                  .ok());
  ASSERT_EQ(gen.Wait(absl::Seconds(60)), 0) << gen.Log();
  auto run = [&](const std::vector<std::string>& env, const std::string& name) {
    std::vector<std::string> argv = {"/usr/bin/env"};
    argv.insert(argv.end(), env.begin(), env.end());
    argv.insert(argv.end(),
                {testing::BuildDir() + "/tools/detourctl/detourctl", "--coordinator=" + address_,
                 "--tls_ca=" + certs + "/ca.crt", "--tls_cert=" + certs + "/alice.crt",
                 "--tls_key=" + certs + "/alice.key", "list"});
    ChildProcess p;
    EXPECT_TRUE(p.Start(argv, dir_ + "/" + name + ".out").ok());
    const int code = p.Wait(absl::Seconds(60)).value_or(-1);
    return std::make_pair(code, p.Log());
  };
  std::pair<int, std::string> r = run({"-u", "GRPC_VERBOSITY"}, "quiet");
  EXPECT_EQ(r.first, 3) << r.second;
  EXPECT_THAT(r.second, HasSubstr("detourctl: list: coordinator " + address_ + " unreachable"));
  EXPECT_THAT(r.second, HasSubstr("detourctl: hint: " + address_ + " speaks plaintext"));
  EXPECT_THAT(r.second, ::testing::Not(HasSubstr("ssl_transport_security"))) << r.second;
  r = run({"GRPC_VERBOSITY=error"}, "verbose");
  EXPECT_EQ(r.first, 3) << r.second;
  EXPECT_THAT(r.second, ::testing::ContainsRegex("ERROR [a-z]+: grpc: Handshake failed"))
      << r.second;
}

// A watch gives up after --reconnect_for and says so (exit 3); a coordinator
// never reached is reported at once.
TEST_F(JobServiceTest, DetourctlWatchGivesUpAfterReconnectFor) {
  auto created = store_->Create(TinySpec("gone"), absl::Now(), "stored");
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string ctl = testing::BuildDir() + "/tools/detourctl/detourctl";
  ChildProcess watch;
  ASSERT_TRUE(watch
                  .Start({ctl, "--coordinator=" + address_, "--insecure", "watch", created->id(),
                          "--reconnect_for=2s"},
                         dir_ + "/watch.out")
                  .ok());
  ASSERT_TRUE(Eventually([&] { return absl::StrContains(watch.Log(), " pending"); }))
      << watch.Log();
  StopService();
  EXPECT_EQ(watch.Wait(absl::Seconds(60)), 3) << watch.Log();
  EXPECT_THAT(watch.Log(), HasSubstr("gave up after"));
  EXPECT_THAT(watch.Log(), HasSubstr("(--reconnect_for=2s)"));

  ChildProcess never;
  ASSERT_TRUE(never
                  .Start({ctl, "--coordinator=" + address_, "--insecure", "watch", created->id()},
                         dir_ + "/never.out")
                  .ok());
  EXPECT_EQ(never.Wait(absl::Seconds(60)), 3) << never.Log();
  EXPECT_THAT(never.Log(), HasSubstr("unreachable"));
  EXPECT_THAT(never.Log(), ::testing::Not(HasSubstr("reconnecting")));
}

// A --token_file others may read is refused, as ssh refuses such keys.
TEST_F(OwnedJobsTest, DetourctlRefusesATokenFileOthersMayRead) {
  const std::string ctl = testing::BuildDir() + "/tools/detourctl/detourctl";
  const std::string token_file = dir_ + "/open.token";
  {
    std::ofstream out(token_file);
    out << kAlice << "\n";
  }
  auto run = [&](const std::string& name) {
    ChildProcess p;
    EXPECT_TRUE(p.Start({ctl, "--coordinator=" + address_, "--insecure",
                         "--token_file=" + token_file, "list"},
                        dir_ + "/" + name + ".out")
                    .ok());
    const int code = p.Wait(absl::Seconds(60)).value_or(-1);
    return std::make_pair(code, p.Log());
  };
  ::chmod(token_file.c_str(), 0644);
  std::pair<int, std::string> result = run("open");
  EXPECT_EQ(result.first, 2) << result.second;
  EXPECT_THAT(result.second, HasSubstr(token_file + " has mode 0644"));
  EXPECT_THAT(result.second, HasSubstr("chmod 600 " + token_file));
  ::chmod(token_file.c_str(), 0640);
  result = run("group");
  EXPECT_EQ(result.first, 2) << result.second;
  EXPECT_THAT(result.second, HasSubstr("has mode 0640"));
  ::chmod(token_file.c_str(), 0600);
  result = run("private");
  EXPECT_EQ(result.first, 0) << result.second;
}

}  // namespace
}  // namespace detour
