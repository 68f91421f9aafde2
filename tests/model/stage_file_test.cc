// The stage-file container: round trip, and malformed files refused by name.
#include "worker/model/stage_file.h"

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace detour::model {
namespace {

TEST(StageFileTest, RoundTripsAndRefusesMalformedFiles) {
  const std::string floats(24, '\x01');  // 2x3 fp32
  const std::string step(8, '\0');
  std::vector<StageTensorRecord> records(2);
  records[0].name = "layers.0.wq";
  records[0].shape = {2, 3};
  records[0].data = floats;
  records[1].name = "layers.0.wq.adam_step";
  records[1].dtype = StageDType::kInt64;
  records[1].data = step;  // a scalar
  const std::string bytes = EncodeStageFile(records);
  auto back = DecodeStageFile(bytes, "s.bin");
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ((*back)[0].name, "layers.0.wq");
  EXPECT_EQ((*back)[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ((*back)[0].data, floats);
  EXPECT_TRUE((*back)[1].shape.empty());
  EXPECT_EQ(EncodeStageFile(*back), bytes);

  struct Case {
    std::string bytes, message;
  };
  std::string wrong_size = EncodeStageFile(records);
  wrong_size[8 + 4 + 4 + 11 + 2 + 8] = 9;  // second dimension 3 -> 9
  std::vector<StageTensorRecord> twice = {records[0], records[0]};
  const Case cases[] = {
      {"", "no DTRSTG01 header"},
      {"DTRSTG01", "truncated before the tensor count"},
      {bytes.substr(0, bytes.size() - 1), "tensor 1 (layers.0.wq.adam_step): truncated"},
      {bytes.substr(0, 30), "2 tensors announced in 30 bytes"},
      {bytes.substr(0, 50), "tensor 0 (layers.0.wq): truncated"},
      {bytes + "z", "1 bytes after the last tensor"},
      {wrong_size, "24 data bytes for 18 elements"},
      {EncodeStageFile(twice), "appears twice"},
  };
  for (const Case& c : cases) {
    auto r = DecodeStageFile(c.bytes, "dir/stage-1.bin");
    ASSERT_FALSE(r.ok()) << c.message;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(r.status().message().find("dir/stage-1.bin: "), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find(c.message), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace detour::model
