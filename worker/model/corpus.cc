#include "worker/model/corpus.h"

#include <array>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "worker/model/text_data.h"

namespace detour::model {
namespace {

// Word lists written for this project.
constexpr std::array<const char*, 16> kNames = {"Ana",  "Ben",  "Cleo", "Dario", "Eva",  "Farid",
                                                "Gita", "Hugo", "Iris", "Jonas", "Kira", "Leo",
                                                "Mina", "Noah", "Olga", "Pavel"};
constexpr std::array<const char*, 12> kFruits = {"apples",   "pears",  "plums",   "lemons",
                                                 "cherries", "figs",   "oranges", "grapes",
                                                 "peaches",  "melons", "berries", "dates"};
constexpr std::array<const char*, 10> kColors = {"red",   "blue",   "green",  "yellow", "white",
                                                 "black", "orange", "purple", "gray",   "brown"};
constexpr std::array<const char*, 14> kAnimals = {"cat",  "dog",  "horse", "fox",   "owl",
                                                  "goat", "duck", "bear",  "mouse", "rabbit",
                                                  "wolf", "frog", "sheep", "crow"};
constexpr std::array<const char*, 12> kPlaces = {"garden",  "market", "river",   "forest",
                                                 "village", "harbor", "library", "kitchen",
                                                 "station", "meadow", "bridge",  "school"};
constexpr std::array<const char*, 10> kAdjectives = {
    "small", "old", "quiet", "quick", "happy", "tired", "clever", "brave", "lazy", "curious"};
constexpr std::array<const char*, 10> kVerbs = {"watches", "follows", "finds", "helps", "greets",
                                                "chases",  "visits",  "calls", "hears", "meets"};
constexpr std::array<const char*, 7> kDays = {"Monday", "Tuesday",  "Wednesday", "Thursday",
                                              "Friday", "Saturday", "Sunday"};
constexpr std::array<const char*, 21> kNumberWords = {
    "zero",     "one",     "two",     "three",     "four",     "five",     "six",
    "seven",    "eight",   "nine",    "ten",       "eleven",   "twelve",   "thirteen",
    "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"};

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return SplitMix64(&state_); }
  int Uniform(int n) { return static_cast<int>(Next() % static_cast<uint64_t>(n)); }
  template <typename A>
  const char* Pick(const A& a) {
    return a[Uniform(static_cast<int>(a.size()))];
  }

 private:
  uint64_t state_;
};

std::string Capitalize(std::string s) {
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = s[0] - 'a' + 'A';
  return s;
}

std::string Arithmetic(Rng& rng) {
  std::vector<std::string> lines;
  const int n = 3 + rng.Uniform(4);
  for (int i = 0; i < n; ++i) {
    const int a = rng.Uniform(20);
    const int b = rng.Uniform(20);
    switch (rng.Uniform(4)) {
      case 0: lines.push_back(absl::StrCat(a, " plus ", b, " is ", a + b, ".")); break;
      case 1: lines.push_back(absl::StrCat(a + b, " minus ", b, " is ", a, ".")); break;
      case 2:
        lines.push_back(absl::StrCat(a % 10, " times ", b % 10, " is ", (a % 10) * (b % 10), "."));
        break;
      default:
        lines.push_back(absl::StrCat(Capitalize(kNumberWords[a]), " and ", kNumberWords[b % 11],
                                     " make ", a + b % 11, "."));
    }
  }
  return absl::StrJoin(lines, " ");
}

std::string Counting(Rng& rng) {
  const int start = rng.Uniform(30);
  const int len = 4 + rng.Uniform(8);
  const int step = 1 + rng.Uniform(3);
  std::vector<std::string> nums;
  for (int i = 0; i < len; ++i) nums.push_back(absl::StrCat(start + i * step));
  std::string s =
      absl::StrCat("Count from ", start, " by ", step, ": ", absl::StrJoin(nums, ", "), ".");
  const int d = rng.Uniform(7);
  absl::StrAppend(&s, " After ", kDays[d], " comes ", kDays[(d + 1) % 7], ", and after ",
                  kDays[(d + 1) % 7], " comes ", kDays[(d + 2) % 7], ".");
  return s;
}

std::string List(Rng& rng) {
  const int n = 2 + rng.Uniform(4);
  std::vector<std::string> colors;
  for (int i = 0; i < n; ++i) colors.push_back(rng.Pick(kColors));
  std::string list = absl::StrJoin(colors.begin(), colors.end() - 1, ", ");
  const char* place = rng.Pick(kPlaces);
  return absl::StrCat("In the ", place, " there are ", n, " flags: ", list, " and ", colors.back(),
                      ". The last flag is ", colors.back(), " and the first flag is ", colors[0],
                      ".");
}

std::string Story(Rng& rng) {
  const int ia = rng.Uniform(static_cast<int>(kNames.size()));
  const int ib =
      (ia + 1 + rng.Uniform(static_cast<int>(kNames.size()) - 1)) % static_cast<int>(kNames.size());
  const char* a = kNames[ia];
  const char* b = kNames[ib];
  const char* fruit = rng.Pick(kFruits);
  const int have = 1 + rng.Uniform(9);
  const int give = 1 + rng.Uniform(9);
  const char* place = rng.Pick(kPlaces);
  std::string s = absl::StrCat(a, " goes to the ", place, " on ", rng.Pick(kDays), ". ", a, " has ",
                               have, " ", fruit, ". ", b, " gives ", a, " ", give, " more ", fruit,
                               ". Now ", a, " has ", have + give, " ", fruit, ".");
  if (rng.Uniform(2) == 0 && have + give > 2) {
    const int eat = 1 + rng.Uniform(2);
    absl::StrAppend(&s, " ", a, " eats ", eat, " of them, so ", a, " has ", have + give - eat, " ",
                    fruit, " left.");
  }
  absl::StrAppend(&s, " Then ", a, " and ", b, " walk home together.");
  return s;
}

std::string Scene(Rng& rng) {
  std::vector<std::string> sentences;
  const int n = 2 + rng.Uniform(3);
  for (int i = 0; i < n; ++i) {
    const char* adj = rng.Pick(kAdjectives);
    const char* animal = rng.Pick(kAnimals);
    const char* verb = rng.Pick(kVerbs);
    const char* other = rng.Pick(kAnimals);
    const char* place = rng.Pick(kPlaces);
    switch (rng.Uniform(3)) {
      case 0:
        sentences.push_back(absl::StrCat("The ", adj, " ", animal, " ", verb, " the ", other,
                                         " near the ", place, "."));
        break;
      case 1:
        sentences.push_back(
            absl::StrCat("A ", animal, " is an animal, and a ", place, " is a place."));
        break;
      default:
        sentences.push_back(
            absl::StrCat("Every ", animal, " in the ", place, " is ", adj, " today."));
    }
  }
  return absl::StrJoin(sentences, " ");
}

}  // namespace

std::string GenerateCorpus(uint64_t seed, size_t approx_bytes) {
  Rng rng(seed);
  std::string text;
  text.reserve(approx_bytes + 1024);
  while (text.size() < approx_bytes) {
    std::string para;
    switch (rng.Uniform(5)) {
      case 0: para = Arithmetic(rng); break;
      case 1: para = Counting(rng); break;
      case 2: para = List(rng); break;
      case 3: para = Story(rng); break;
      default: para = Scene(rng);
    }
    absl::StrAppend(&text, para, "\n\n");
  }
  return text;
}

const std::string& EmbeddedCorpus() {
  static const std::string* const corpus = new std::string(GenerateCorpus(2026, 3 << 20));
  return *corpus;
}

}  // namespace detour::model
