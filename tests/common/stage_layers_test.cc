#include "common/stage_layers.h"

#include "gtest/gtest.h"

namespace detour {
namespace {

TEST(StageLayers, ContiguousCoverWithLargerStagesLast) {
  for (int layers = 1; layers <= 40; ++layers) {
    for (int stages = 1; stages <= layers; ++stages) {
      int next = 0;
      int previous_size = 0;
      for (int s = 0; s < stages; ++s) {
        auto span = StageLayers(layers, stages, s);
        ASSERT_TRUE(span.ok());
        EXPECT_EQ(span->begin, next);
        EXPECT_GE(span->size(), layers / stages);
        EXPECT_LE(span->size(), layers / stages + 1);
        EXPECT_GE(span->size(), previous_size);  // never smaller than before
        previous_size = span->size();
        next = span->end;
      }
      EXPECT_EQ(next, layers);
    }
  }
  EXPECT_EQ(StageLayers(8, 3, 0)->size(), 2);
  EXPECT_EQ(StageLayers(8, 3, 1)->begin, 2);
  EXPECT_EQ(StageLayers(8, 3, 2)->size(), 3);
}

TEST(StageLayers, RejectsBadCounts) {
  EXPECT_FALSE(StageLayers(4, 5, 0).ok());
  EXPECT_FALSE(StageLayers(4, 0, 0).ok());
  EXPECT_FALSE(StageLayers(4, 2, 2).ok());
  EXPECT_FALSE(StageLayers(4, 2, -1).ok());
}

}  // namespace
}  // namespace detour
