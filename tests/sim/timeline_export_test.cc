#include "common/sim/timeline_export.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include "common/sim/json_writer.h"
#include "tests/sim/sim_test_util.h"

namespace detour::sim {
namespace {

struct Fixture {
  CostModel cost;
  Plan plan;
  SimResult result;
};

Fixture Make() {
  auto cost = CostModel::FromTables(testing::UniformTables(3, 2, 1.0, 2.0, 0.5, 0.1, 0.2, 3));
  EXPECT_TRUE(cost.ok());
  Plan plan;
  plan.assignment.stage_nodes = {{0}, {1, 2}};
  for (int m = 0; m < 4; ++m) {
    Route r;
    r.microbatch = m;
    r.nodes = {0, 1 + m % 2};
    r.stages = {0, 1};
    plan.routes.push_back(r);
  }
  auto result = Simulate(*cost, plan);
  EXPECT_TRUE(result.ok());
  return {*cost, plan, *result};
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

TEST(TimelineExportTest, ChromeTraceIsValidJsonWithOneEventPerActivity) {
  Fixture f = Make();
  const std::string json = ChromeTraceJson(f.cost, f.plan, f.result, "test \"plan\"");
  google::protobuf::Struct parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &parsed).ok()) << json;
  const auto& events = parsed.fields().at("traceEvents").list_value().values();
  size_t complete = 0;
  for (const auto& e : events) {
    if (e.struct_value().fields().at("ph").string_value() == "X") ++complete;
  }
  size_t expected = 0;
  for (const auto& v : f.result.compute) expected += v.size();
  for (const auto& v : f.result.sends) expected += v.size();
  EXPECT_EQ(complete, expected);
  // 4 microbatches × (F, L, B) on the data node + 4 × (F, B) on stage 1.
  EXPECT_EQ(Count(json, "\"cat\":\"forward\""), 8u);
  EXPECT_EQ(Count(json, "\"cat\":\"loss\""), 4u);
}

TEST(TimelineExportTest, SvgHasRowsLegendAndColours) {
  Fixture f = Make();
  SvgOptions options;
  options.title = "demo <plan>";
  const std::string svg = TimelineSvg(f.cost, f.plan, f.result, options);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("demo &lt;plan&gt;"), std::string::npos);  // Escaped for XML.
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  for (const char* label : {"forward", "backward", "loss + head", "send activation",
                            "send gradient", "idle (bubble)", "n0 · stage 0", "n2 · stage 1"}) {
    EXPECT_NE(svg.find(label), std::string::npos) << label;
  }
  EXPECT_EQ(Count(svg, "fill=\"#4e79a7\""), 8u + 1u);  // Forward bars + legend.
  // A fixed time axis longer than the run squeezes the bars.
  options.max_time_s = 10 * f.result.iteration_time_s;
  EXPECT_NE(TimelineSvg(f.cost, f.plan, f.result, options), svg);
}

TEST(JsonWriterTest, EscapesAndNests) {
  JsonWriter w(0);
  w.BeginObject();
  w.Key("a\"b");
  w.BeginArray();
  w.Int(1);
  w.Number(0.5);
  w.String("x\ny");
  w.Bool(true);
  w.Null();
  w.EndArray();
  w.Key("e");
  w.BeginObject();
  w.EndObject();
  w.Key("l");
  w.IntArray({1, 2});
  w.EndObject();
  EXPECT_EQ(w.str(), R"({"a\"b":[1,0.5,"x\ny",true,null],"e":{},"l":[1, 2]})");
}

}  // namespace
}  // namespace detour::sim
