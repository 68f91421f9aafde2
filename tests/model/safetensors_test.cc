#include "worker/model/safetensors.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/files.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;

std::string Le64(uint64_t n) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));
  return s;
}

// A file from a header text and a buffer.
std::string File(const std::string& header, const std::string& buffer) {
  return Le64(header.size()) + header + buffer;
}

std::string Floats(std::vector<float> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(SafetensorsTest, RoundTripsTensorsAndMetadata) {
  const std::string a = Floats({1, 2, 3, 4, 5, 6});
  const std::string b(2 * 2, '\x7f');  // BF16 [2]
  const std::string c;                 // F32 [0, 3]
  const std::string d = Floats({42});  // scalar
  std::vector<SafetensorsTensor> in = {{"w.a", SafetensorsDType::kF32, {2, 3}, a},
                                       {"b", SafetensorsDType::kBF16, {2}, b},
                                       {"empty", SafetensorsDType::kF32, {0, 3}, c},
                                       {"scalar \"q\"", SafetensorsDType::kF32, {}, d}};
  auto bytes = EncodeSafetensors(in, {{"format", "pt"}, {"note", "x\ny"}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  // The buffer starts 8-aligned.
  uint64_t n = 0;
  std::memcpy(&n, bytes->data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  auto parsed = ParseSafetensors(*bytes, "t.safetensors");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->tensors.size(), 4u);
  EXPECT_EQ(parsed->metadata.at("format"), "pt");
  EXPECT_EQ(parsed->metadata.at("note"), "x\ny");
  for (const SafetensorsTensor& t : in) {
    const SafetensorsTensor* p = parsed->Find(t.name);
    ASSERT_NE(p, nullptr) << t.name;
    EXPECT_EQ(p->dtype, t.dtype);
    EXPECT_EQ(p->shape, t.shape);
    EXPECT_EQ(p->data, t.data) << t.name;
  }
  EXPECT_EQ(parsed->Find("scalar \"q\"")->numel(), 1u);
  EXPECT_EQ(parsed->Find("nope"), nullptr);
}

TEST(SafetensorsTest, ReadsAFileWrittenByTheReferenceLayout) {
  // As the Python package writes it: offsets in a different order than the
  // keys, unpadded header, metadata first.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F16","shape":[1],"data_offsets":[4,6]},)"
      R"("a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})";
  const std::string buffer = std::string("\x01\x00\x00\x00", 4) + std::string("\x00\x3c", 2);
  auto p = ParseSafetensors(File(header, buffer), "ref");
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->tensors.size(), 2u);
  EXPECT_EQ(p->tensors[0].name, "a");  // offset order
  EXPECT_EQ(p->Find("b")->dtype, SafetensorsDType::kF16);
}

TEST(SafetensorsTest, WritesAndMapsFiles) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("st." + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string a = Floats({1.5f, -2});
  const std::string path = (dir / "m.safetensors").string();
  ASSERT_TRUE(WriteSafetensorsFile(path, {{"x", SafetensorsDType::kF32, {2}, a}}, {}).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->contents().Find("x")->data, a);
  EXPECT_EQ(SafetensorsFile::Open((dir / "missing").string()).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(WriteFileAtomically((dir / "bad").string(), "not a safetensors file").ok());
  EXPECT_EQ(SafetensorsFile::Open((dir / "bad").string()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(SafetensorsFile::Open(dir.string()).ok());  // a directory
  fs::remove_all(dir);
}

struct BadCase {
  const char* label;
  std::string bytes;
  const char* expect;  // in the message
};

TEST(SafetensorsTest, RefusesMalformedFilesNamingTheProblem) {
  auto entry = [](const std::string& name, const std::string& dtype, const std::string& shape,
                  uint64_t b, uint64_t e) {
    return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
           ",\"data_offsets\":[" + std::to_string(b) + "," + std::to_string(e) + "]}";
  };
  const std::string eight(8, '\0');
  const std::vector<BadCase> cases = {
      {"short", "abc", "too short"},
      {"huge header", Le64(uint64_t{1} << 40) + "{}", "more than the limit"},
      {"header past end", Le64(100) + "{}", "past the end"},
      {"not an object", File("[1]", ""), "does not start with '{'"},
      {"bad json", File("{\"a\":", ""), "JSON byte"},
      {"duplicate",
       File("{" + entry("a", "F32", "[1]", 0, 4) + "," + entry("a", "F32", "[1]", 4, 8) + "}",
            eight),
       "duplicate key \"a\""},
      {"unknown dtype", File("{" + entry("w", "F8_E4M3", "[1]", 0, 1) + "}", "x"),
       "tensor \"w\": unknown dtype"},
      {"negative dim", File("{" + entry("w", "F32", "[-1]", 0, 4) + "}", "xxxx"),
       "shape[0] is not a non-negative"},
      {"fraction dim", File("{" + entry("w", "F32", "[1.5]", 0, 4) + "}", "xxxx"), "shape[0]"},
      {"overflow",
       File("{" + entry("w", "F64", "[4294967296,4294967296,4294967296]", 0, 8) + "}", eight),
       "needs more bytes than the buffer"},
      {"size mismatch", File("{" + entry("w", "F32", "[3]", 0, 8) + "}", eight + "1234"),
       "holds 8 bytes but F32 [3] needs 12"},
      {"past buffer", File("{" + entry("w", "U8", "[16]", 0, 16) + "}", eight), "needs more bytes"},
      {"offsets past buffer", File("{" + entry("w", "U8", "[0]", 9, 9) + "}", eight),
       "reach past the byte buffer"},
      {"reversed", File("{" + entry("w", "U8", "[0]", 4, 2) + "}", eight), "reversed"},
      {"overlap",
       File("{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[1]", 4, 8) + "}",
            eight),
       "(overlap)"},
      {"gap", File("{" + entry("a", "F32", "[1]", 4, 8) + "}", eight), "(gap)"},
      {"trailing", File("{" + entry("a", "F32", "[1]", 0, 4) + "}", eight), "trailing bytes"},
      {"unknown field",
       File("{\"w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0],\"x\":1}}", ""),
       "unknown field \"x\""},
      {"no offsets", File("{\"w\":{\"dtype\":\"U8\",\"shape\":[0]}}", ""), "data_offsets"},
      {"metadata not string", File("{\"__metadata__\":{\"k\":1}}", ""),
       "__metadata__ \"k\" is not a string"},
      {"too many dims", File("{" + entry("w", "U8", "[1,1,1,1,1,1,1,1,1]", 0, 1) + "}", "x"),
       "dimensions"},
      {"empty name", File("{" + entry("", "U8", "[1]", 0, 1) + "}", "x"), "empty name"},
  };
  for (const BadCase& c : cases) {
    auto p = ParseSafetensors(c.bytes, "f.safetensors");
    ASSERT_FALSE(p.ok()) << c.label;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << c.label;
    EXPECT_NE(p.status().message().find(c.expect), std::string::npos)
        << c.label << ": " << p.status().message();
    EXPECT_EQ(p.status().message().rfind("f.safetensors", 0), 0u) << c.label;
  }
}

TEST(SafetensorsTest, EncodeRefusesInconsistentTensors) {
  const std::string four(4, '\0');
  EXPECT_FALSE(EncodeSafetensors({{"a", SafetensorsDType::kF32, {2}, four}}, {}).ok());
  EXPECT_FALSE(
      EncodeSafetensors(
          {{"a", SafetensorsDType::kF32, {1}, four}, {"a", SafetensorsDType::kF32, {1}, four}}, {})
          .ok());
  EXPECT_FALSE(EncodeSafetensors({{"", SafetensorsDType::kF32, {1}, four}}, {}).ok());
  EXPECT_FALSE(EncodeSafetensors({{"__metadata__", SafetensorsDType::kF32, {1}, four}}, {}).ok());
  EXPECT_FALSE(EncodeSafetensors({{"a", SafetensorsDType::kF32, {-1}, ""}}, {}).ok());
}

}  // namespace
}  // namespace detour::model
