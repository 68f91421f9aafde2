#include "coordinator/service_discovery.h"

#include "common/json.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

v1::WorkerInfo Worker(const std::string& id, const std::string& metrics, v1::WorkerState state) {
  v1::WorkerInfo w;
  w.set_worker_id(id);
  w.set_region("Oregon \"west\"");
  w.set_device("cpu");
  w.set_metrics_address(metrics);
  w.set_state(state);
  return w;
}

TEST(ServiceDiscoveryTest, ListsTheCoordinatorThenWorkersWithMetrics) {
  const std::string json =
      ServiceDiscoveryJson("10.0.0.1:9470", {Worker("w1", "10.0.0.2:9471", v1::WORKER_STATE_BUSY),
                                             Worker("w2", "", v1::WORKER_STATE_IDLE),
                                             Worker("w3", "[::1]:9471", v1::WORKER_STATE_LOST)});
  auto parsed = ParseJson(json);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << json;
  ASSERT_TRUE(parsed->is_array());
  ASSERT_EQ(parsed->items().size(), 3u) << json;  // w2 serves no metrics
  const JsonValue& coordinator = parsed->items()[0];
  ASSERT_EQ(coordinator.Find("targets")->items().size(), 1u);
  EXPECT_EQ(coordinator.Find("targets")->items()[0].string_value(), "10.0.0.1:9470");
  EXPECT_EQ(coordinator.Find("labels")->Find("role")->string_value(), "coordinator");
  const JsonValue& w1 = parsed->items()[1];
  EXPECT_EQ(w1.Find("targets")->items()[0].string_value(), "10.0.0.2:9471");
  const JsonValue* labels = w1.Find("labels");
  EXPECT_EQ(labels->Find("role")->string_value(), "worker");
  EXPECT_EQ(labels->Find("__meta_detour_worker_id")->string_value(), "w1");
  EXPECT_EQ(labels->Find("__meta_detour_region")->string_value(), "Oregon \"west\"");
  EXPECT_EQ(labels->Find("__meta_detour_worker_state")->string_value(), "busy");
  EXPECT_EQ(parsed->items()[2].Find("labels")->Find("__meta_detour_worker_state")->string_value(),
            "lost");
}

TEST(ServiceDiscoveryTest, EmptyClusterIsAnEmptyList) {
  auto parsed = ParseJson(ServiceDiscoveryJson("", {}));
  ASSERT_TRUE(parsed.ok());
  ASSERT_TRUE(parsed->is_array());
  EXPECT_TRUE(parsed->items().empty());
}

}  // namespace
}  // namespace detour
