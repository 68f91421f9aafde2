// Observability end to end: a real coordinator and workers run a K-FAC job
// while the real Prometheus (Debian's /usr/bin/prometheus) finds them through
// the coordinator's HTTP service discovery, scrapes them, and evaluates
// deploy/prometheus/detour.rules.yml; every query of
// deploy/grafana/detour-dashboard.json and every rule must then parse and
// return data. A second test checks docs/METRICS.md against the families the
// daemons expose.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/json.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/local_cluster.h"
#include "tests/e2e/micro_job.h"
#include "tests/e2e/process.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kPrometheus[] = "/usr/bin/prometheus";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// HTTP/1.0 GET on loopback (so Prometheus answers without chunking); the
// body, or an error for no answer or a status other than 200.
absl::StatusOr<std::string> Get(int port, const std::string& path) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("connect to port ", port, " failed"));
  timeval timeout = {10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (::write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    ::close(fd);
    return absl::UnavailableError("write failed");
  }
  std::string response;
  char buffer[16384];
  ssize_t n;
  while ((n = ::read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  ::close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (body == std::string::npos) return absl::UnavailableError("no HTTP response");
  if (!absl::StartsWith(response, "HTTP/1.0 200") && !absl::StartsWith(response, "HTTP/1.1 200")) {
    return absl::InternalError(response.substr(0, 2000));
  }
  return response.substr(body + 4);
}

std::string UrlEncode(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      absl::StrAppend(&out, "%", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

// Family names from "# TYPE name type" lines of an exposition.
std::set<std::string> Families(const std::string& exposition) {
  std::set<std::string> names;
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (!absl::ConsumePrefix(&line, "# TYPE ")) continue;
    names.insert(std::string(line.substr(0, line.find(' '))));
  }
  return names;
}

// /metrics of a daemon, body only.
std::string Scrape(int port) {
  auto body = Get(port, "/metrics");
  EXPECT_TRUE(body.ok()) << body.status();
  return body.ok() ? *body : "";
}

// Metric names (and recording-rule names) an expression reads.
std::set<std::string> MetricNames(const std::string& expr) {
  static const std::regex kName(R"(\b(up|(?:detour|process)_[a-z0-9_]+|detour:[a-z0-9_:]+)\b)");
  std::set<std::string> names;
  for (auto it = std::sregex_iterator(expr.begin(), expr.end(), kName);
       it != std::sregex_iterator(); ++it) {
    names.insert((*it)[1]);
  }
  return names;
}

v1::JobSpec KfacMicroJob(int iterations) {
  v1::JobSpec spec = MicroJob(3, 1, 1, 0.0, iterations);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_KFAC);
  spec.mutable_optimizer()->mutable_kfac()->set_lr(3e-3);
  return *NormalizeJobSpec(spec);
}

class ObservabilityTest : public E2eTest {
 protected:
  // Waits for the job to run with `iterations` done.
  bool WaitForIterations(int port, const std::string& id, uint64_t iterations) {
    return Eventually(
        [&] {
          const v1::Job job = GetJob(port, id);
          return job.state() == v1::JOB_STATE_RUNNING && job.progress().iteration() >= iterations;
        },
        absl::Seconds(40));
  }

  void CancelJob(int port, const std::string& id) {
    auto stub = v1::JobService::NewStub(Channel(port));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::CancelJobRequest request;
    request.set_job_id(id);
    v1::Job job;
    grpc::Status status = stub->Cancel(&context, request, &job);
    EXPECT_TRUE(status.ok()) << status.error_message();
  }

  // Runs an instant query; the result array (empty on any error, reported).
  std::vector<JsonValue> Query(const std::string& expr, std::string* error) {
    auto body = Get(prometheus_port_, "/api/v1/query?query=" + UrlEncode(expr));
    if (!body.ok()) {
      *error = std::string(body.status().message());
      return {};
    }
    auto parsed = ParseJson(*body);
    if (!parsed.ok() || parsed->Find("status") == nullptr ||
        parsed->Find("status")->string_value() != "success") {
      *error = body->substr(0, 500);
      return {};
    }
    const JsonValue* result = parsed->Find("data")->Find("result");
    error->clear();
    return result != nullptr ? result->items() : std::vector<JsonValue>{};
  }

  // Polls until every expression returns data; returns those that did not,
  // with the reason.
  std::map<std::string, std::string> ExpressionsWithoutData(const std::vector<std::string>& exprs,
                                                            absl::Duration timeout) {
    std::map<std::string, std::string> missing;
    for (const std::string& e : exprs) missing[e] = "not queried";
    const absl::Time deadline = absl::Now() + timeout;
    while (!missing.empty()) {
      for (auto it = missing.begin(); it != missing.end();) {
        std::string error;
        if (!Query(it->first, &error).empty()) {
          it = missing.erase(it);
        } else {
          it->second = error.empty() ? "empty result" : error;
          ++it;
        }
      }
      if (missing.empty() || absl::Now() > deadline) break;
      absl::SleepFor(absl::Milliseconds(500));
    }
    return missing;
  }

  int prometheus_port_ = 0;
};

TEST_F(ObservabilityTest, PrometheusFindsTheClusterAndEveryPanelAndRuleHasData) {
  if (!std::filesystem::exists(kPrometheus)) {
    GTEST_SKIP() << kPrometheus << " is missing (tools/install_deps.sh installs it)";
  }
  Daemon c = StartCoordinator({"--job_metrics_retention=10m"});
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 3, WorkerFlags());
  ASSERT_GT(c.metrics_port, 0);

  // Service discovery lists the coordinator, then each worker's endpoint.
  auto sd = Get(c.metrics_port, "/prometheus/targets");
  ASSERT_TRUE(sd.ok()) << sd.status();
  auto groups = ParseJson(*sd);
  ASSERT_TRUE(groups.ok()) << groups.status() << "\n" << *sd;
  ASSERT_EQ(groups->items().size(), 4u) << *sd;
  EXPECT_EQ(groups->items()[0].Find("targets")->items()[0].string_value(),
            absl::StrCat("127.0.0.1:", c.metrics_port));
  std::map<std::string, std::string> sd_workers;
  for (size_t i = 1; i < groups->items().size(); ++i) {
    const JsonValue& g = groups->items()[i];
    sd_workers[g.Find("labels")->Find("__meta_detour_worker_id")->string_value()] =
        g.Find("targets")->items()[0].string_value();
  }
  for (const Daemon& w : workers) {
    EXPECT_EQ(sd_workers[w.id], absl::StrCat("127.0.0.1:", w.metrics_port)) << *sd;
  }

  // The shipped configuration, pointed at this coordinator, scraping fast.
  std::string config = ReadFile(SourceDir() + "/deploy/prometheus.yml");
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"coordinator.example:9470", absl::StrCat("127.0.0.1:", c.metrics_port)},
           {"scrape_interval: 15s", "scrape_interval: 1s"},
           {"evaluation_interval: 15s", "evaluation_interval: 1s"},
           {"refresh_interval: 30s", "refresh_interval: 1s"},
           {"- prometheus/detour.rules.yml",
            absl::StrCat("- ", SourceDir(), "/deploy/prometheus/detour.rules.yml")}}) {
    ASSERT_TRUE(absl::StrContains(config, from)) << "deploy/prometheus.yml has no " << from;
    absl::StrReplaceAll({{from, to}}, &config);
  }
  const std::string config_path = dir_ + "/prometheus.yml";
  std::ofstream(config_path) << config;
  // Not a structured binding: lambdas below capture the port, which C++17
  // allows only for variables (clang refuses it; the checked builds use clang).
  const std::pair<int, int> occupied = OccupyPort();
  ::close(occupied.first);
  const int port = occupied.second;
  prometheus_port_ = port;
  ChildProcess prometheus;
  ASSERT_TRUE(
      prometheus
          .Start(
              {kPrometheus, "--config.file=" + config_path, "--storage.tsdb.path=" + dir_ + "/tsdb",
               absl::StrCat("--web.listen-address=127.0.0.1:", port), "--log.level=warn"},
              dir_ + "/prometheus.log")
          .ok());
  ASSERT_TRUE(Eventually([&] { return Get(port, "/-/ready").ok(); }, absl::Seconds(20)))
      << prometheus.Log();

  // A K-FAC job over three stages: links between workers, K-FAC tasks.
  const v1::Job job = Submit(c.grpc_port, KfacMicroJob(1000));
  ASSERT_TRUE(WaitForIterations(c.grpc_port, job.id(), 3)) << c.process->Log();

  // Every target is found and up.
  ASSERT_TRUE(Eventually(
      [&] {
        std::string error;
        return Query(
                   "count(up{role=\"worker\"} == 1) == 3 and count(up{role=\"coordinator\"} == 1) "
                   "== 1",
                   &error)
                   .size() == 1;
      },
      absl::Seconds(20)))
      << Get(port, "/api/v1/targets").value_or("") << "\n"
      << prometheus.Log();

  // Rules: all loaded and evaluated without error.
  const std::string rules_file = ReadFile(SourceDir() + "/deploy/prometheus/detour.rules.yml");
  const std::regex rule_line(R"(\n\s*- (record|alert):)");
  const int rules_in_file = static_cast<int>(
      std::distance(std::sregex_iterator(rules_file.begin(), rules_file.end(), rule_line),
                    std::sregex_iterator()));
  std::vector<std::string> recorded, alert_inputs;
  ASSERT_TRUE(Eventually(
      [&] {
        recorded.clear();
        alert_inputs.clear();
        auto body = Get(port, "/api/v1/rules");
        if (!body.ok()) return false;
        auto parsed = ParseJson(*body);
        if (!parsed.ok()) return false;
        int healthy = 0;
        for (const JsonValue& group : parsed->Find("data")->Find("groups")->items()) {
          for (const JsonValue& rule : group.Find("rules")->items()) {
            if (rule.Find("health")->string_value() != "ok") return false;
            ++healthy;
            if (rule.Find("type")->string_value() == "recording") {
              recorded.push_back(rule.Find("name")->string_value());
            } else {
              for (const std::string& name : MetricNames(rule.Find("query")->string_value())) {
                alert_inputs.push_back(name);
              }
            }
          }
        }
        return healthy == rules_in_file;
      },
      absl::Seconds(20)))
      << Get(port, "/api/v1/rules").value_or("") << "\n"
      << prometheus.Log();
  // "Returns data": a recording rule's series exist. Alerts are normally
  // empty in a healthy cluster; for them "returns data" means every series
  // they read exists (checked here) and they evaluated without error (their
  // health above).
  std::vector<std::string> exprs = recorded;
  exprs.insert(exprs.end(), alert_inputs.begin(), alert_inputs.end());

  // Every dashboard query, with Grafana's variables filled in.
  auto dashboard = ParseJson(ReadFile(SourceDir() + "/deploy/grafana/detour-dashboard.json"));
  ASSERT_TRUE(dashboard.ok()) << dashboard.status();
  int panel_queries = 0;
  for (const JsonValue& panel : dashboard->Find("panels")->items()) {
    const JsonValue* targets = panel.Find("targets");
    if (targets == nullptr) continue;
    for (const JsonValue& target : targets->items()) {
      exprs.push_back(absl::StrReplaceAll(target.Find("expr")->string_value(),
                                          {{"$__rate_interval", "1m"}, {"$job_id", ".*"}}));
      ++panel_queries;
    }
  }
  EXPECT_GE(panel_queries, 20);
  const auto missing = ExpressionsWithoutData(exprs, absl::Seconds(25));
  EXPECT_TRUE(missing.empty()) << "without data:\n"
                               << absl::StrJoin(missing, "\n", absl::PairFormatter(" -> "));

  // The series say what the job does.
  std::string error;
  EXPECT_EQ(Query(absl::StrCat("detour_worker_info{job_id=\"", job.id(), "\"}"), &error).size(), 3u)
      << error;
  EXPECT_EQ(Query(absl::StrCat("detour_coordinator_job_state{job_id=\"", job.id(),
                               "\",state=\"running\"} == 1"),
                  &error)
                .size(),
            1u);
  EXPECT_EQ(
      Query(absl::StrCat("detour_coordinator_job_progress_ratio{job_id=\"", job.id(), "\"} > 0"),
            &error)
          .size(),
      1u);
  // Two stage boundaries, activations one way and gradients the other.
  EXPECT_GE(Query("detour_worker_link_sent_bytes_total > 0", &error).size(), 4u) << error;

  // The job ends: busy fractions fall to 0 on every worker, the job's state
  // series say cancelled, the workers' info no longer names the job.
  CancelJob(c.grpc_port, job.id());
  for (const Daemon& w : workers) {
    EXPECT_TRUE(Eventually(
        [&] {
          const std::string text = Scrape(w.metrics_port);
          return absl::StrContains(text, "detour_worker_busy_fraction{work=\"pipeline\"} 0\n") &&
                 absl::StrContains(text,
                                   "detour_worker_busy_fraction{work=\"pipeline_and_kfac\"} 0\n") &&
                 absl::StrContains(text, "job_id=\"\",stage=\"\"} 1\n") &&
                 !absl::StrContains(text, "detour_worker_link_sent_bytes_total{");
        },
        absl::Seconds(10)))
        << w.id << ":\n"
        << Scrape(w.metrics_port);
  }
  EXPECT_TRUE(Eventually(
      [&] {
        return Query(absl::StrCat("detour_coordinator_job_state{job_id=\"", job.id(),
                                  "\",state=\"cancelled\"} == 1"),
                     &error)
                   .size() == 1;
      },
      absl::Seconds(10)));
  prometheus.Stop(absl::Seconds(5));
}

// Every family the daemons expose has a row in docs/METRICS.md and every
// documented family is exposed, so the document cannot drift.
TEST_F(ObservabilityTest, MetricsMdMatchesTheScrapes) {
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 3, WorkerFlags());
  const v1::Job job = Submit(c.grpc_port, KfacMicroJob(1000));
  ASSERT_TRUE(WaitForIterations(c.grpc_port, job.id(), 3)) << c.process->Log();

  std::set<std::string> exposed;
  std::map<std::string, std::string> scrapes;  // for promtool
  auto add = [&](const std::string& name, int port) {
    const std::string text = Scrape(port);
    const std::set<std::string> families = Families(text);
    exposed.insert(families.begin(), families.end());
    scrapes[name] = text;
  };
  // While the job runs (links, the job's series), and after (idle).
  add("coordinator-running", c.metrics_port);
  for (const Daemon& w : workers) add(w.id + "-running", w.metrics_port);
  CancelJob(c.grpc_port, job.id());
  ASSERT_TRUE(
      Eventually([&] { return GetJob(c.grpc_port, job.id()).state() == v1::JOB_STATE_CANCELLED; },
                 absl::Seconds(10)));
  add("coordinator-idle", c.metrics_port);
  add(workers[0].id + "-idle", workers[0].metrics_port);

  const std::string doc = ReadFile(SourceDir() + "/docs/METRICS.md");
  std::set<std::string> documented;
  const std::regex row(R"((^|\n)\|\s*`([a-z_][a-z0-9_]*)`)");
  for (auto it = std::sregex_iterator(doc.begin(), doc.end(), row); it != std::sregex_iterator();
       ++it) {
    documented.insert((*it)[2]);
  }
  ASSERT_GT(documented.size(), 40u) << "METRICS.md's tables changed shape?";
  // Families that need an event this test does not cause; still documented.
  const std::map<std::string, std::string> event_only = {
      {"detour_coordinator_microbatches_recovered_total", "only after a recovery"},
      {"detour_worker_state_transfer_bytes_total", "only after a replica joins"},
  };
  for (const std::string& name : exposed) {
    EXPECT_TRUE(documented.count(name)) << name << " is exposed but not in docs/METRICS.md";
  }
  for (const std::string& name : documented) {
    if (event_only.count(name)) continue;
    EXPECT_TRUE(exposed.count(name)) << name << " is in docs/METRICS.md but no daemon exposes it";
  }
  for (const auto& [name, reason] : event_only) {
    EXPECT_TRUE(documented.count(name)) << name << " (" << reason << ") is not documented";
  }

  // A worker behind a proxy registers the address it is told to advertise;
  // a bad one is refused at start.
  StartWorker(c.grpc_port, "proxied", {"--metrics_advertise=metrics.example:9999"});
  auto sd = Get(c.metrics_port, "/prometheus/targets");
  ASSERT_TRUE(sd.ok()) << sd.status();
  EXPECT_THAT(*sd, HasSubstr("{\"targets\":[\"metrics.example:9999\"],\"labels\":{\"role\":"
                             "\"worker\",\"__meta_detour_worker_id\":\"proxied\""));
  std::string refused;
  EXPECT_EQ(
      Run({Bin(kWorker), "--metrics_advertise=nowhere", "--coordinator=127.0.0.1:1"}, &refused), 2);
  EXPECT_THAT(refused, HasSubstr("--metrics_advertise"));

  // And every scrape is valid exposition text.
  if (std::filesystem::exists("/usr/bin/promtool")) {
    for (const auto& [name, text] : scrapes) {
      const std::string file = absl::StrCat(dir_, "/", name, ".prom");
      std::ofstream(file) << text;
      std::string out;
      EXPECT_EQ(Run({"/bin/sh", "-c", absl::StrCat("promtool check metrics < ", file)}, &out,
                    absl::Seconds(30), /*add_security=*/false),
                0)
          << name << ": " << out;
    }
  }
}

}  // namespace
}  // namespace detour::testing
