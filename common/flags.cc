#include "common/flags.h"

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/match.h"

namespace detour {

FlagSet::FlagSet(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

void FlagSet::String(const std::string& name, std::string* value, const std::string& help) {
  flags_.push_back({name, help, "string", value->empty() ? "\"\"" : *value, false, false,
                    [value](const std::string& v) {
                      *value = v;
                      return absl::OkStatus();
                    }});
}

void FlagSet::Int(const std::string& name, int64_t* value, const std::string& help) {
  flags_.push_back(
      {name, help, "int", absl::StrCat(*value), false, false, [value, name](const std::string& v) {
         if (!absl::SimpleAtoi(v, value)) {
           return absl::InvalidArgumentError(
               absl::StrCat("--", name, ": \"", v, "\" is not an integer"));
         }
         return absl::OkStatus();
       }});
}

void FlagSet::Double(const std::string& name, double* value, const std::string& help) {
  flags_.push_back({name, help, "number", absl::StrFormat("%g", *value), false, false,
                    [value, name](const std::string& v) {
                      if (!absl::SimpleAtod(v, value)) {
                        return absl::InvalidArgumentError(
                            absl::StrCat("--", name, ": \"", v, "\" is not a number"));
                      }
                      return absl::OkStatus();
                    }});
}

void FlagSet::Bool(const std::string& name, bool* value, const std::string& help) {
  flags_.push_back({name, help, "bool", *value ? "true" : "false", true, false,
                    [value, name](const std::string& v) {
                      if (!absl::SimpleAtob(v, value)) {
                        return absl::InvalidArgumentError(
                            absl::StrCat("--", name, ": \"", v, "\" is not true or false"));
                      }
                      return absl::OkStatus();
                    }});
}

void FlagSet::Duration(const std::string& name, absl::Duration* value, const std::string& help) {
  flags_.push_back({name, help, "duration", absl::FormatDuration(*value), false, false,
                    [value, name](const std::string& v) {
                      absl::Duration d;
                      if (!absl::ParseDuration(v, &d) || d < absl::ZeroDuration()) {
                        return absl::InvalidArgumentError(absl::StrCat(
                            "--", name, ": \"", v, "\" is not a duration (e.g. 500ms, 10s, 2m)"));
                      }
                      *value = d;
                      return absl::OkStatus();
                    }});
}

void FlagSet::Positional(const std::string& name, const std::string& help) {
  positional_.emplace_back(name, help);
}

FlagSet::Flag* FlagSet::Find(const std::string& name) {
  for (Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string FlagSet::Suggest(const std::string& name) const {
  const Flag* best = nullptr;
  size_t best_distance = 3;
  for (const Flag& f : flags_) {
    const size_t d = EditDistance(name, f.name);
    if (d < best_distance) {
      best_distance = d;
      best = &f;
    }
  }
  return best == nullptr ? "" : absl::StrCat(" (did you mean --", best->name, "?)");
}

bool FlagSet::WasSet(const std::string& name) const {
  for (const Flag& f : flags_) {
    if (f.name == name) return f.set;
  }
  return false;
}

absl::StatusOr<std::vector<std::string>> FlagSet::Parse(int argc, char** argv,
                                                        bool stop_at_positional) {
  return Parse(std::vector<std::string>(argv + 1, argv + argc), stop_at_positional);
}

absl::StatusOr<std::vector<std::string>> FlagSet::Parse(const std::vector<std::string>& args,
                                                        bool stop_at_positional) {
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      positional.insert(positional.end(), args.begin() + i + 1, args.end());
      break;
    }
    if (arg == "--help" || arg == "-h" || arg == "-help") {
      std::cout << Usage();
      return absl::CancelledError("help");
    }
    if (!absl::StartsWith(arg, "-") || arg == "-") {
      if (stop_at_positional) {
        positional.insert(positional.end(), args.begin() + i, args.end());
        break;
      }
      positional.push_back(arg);
      continue;
    }
    std::string body = arg.substr(absl::StartsWith(arg, "--") ? 2 : 1);
    std::string value;
    bool has_value = false;
    if (size_t eq = body.find('='); eq != std::string::npos) {
      value = body.substr(eq + 1);
      body = body.substr(0, eq);
      has_value = true;
    }
    Flag* flag = Find(body);
    if (flag == nullptr && absl::StartsWith(body, "no") && !has_value) {
      Flag* negated = Find(body.substr(2));
      if (negated != nullptr && negated->is_bool) {
        absl::Status s = negated->assign("false");
        if (!s.ok()) return s;
        negated->set = true;
        continue;
      }
    }
    if (flag == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", body, Suggest(body)));
    }
    if (!has_value) {
      if (flag->is_bool) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--", body, ": missing value"));
      }
    }
    absl::Status s = flag->assign(value);
    if (!s.ok()) return s;
    flag->set = true;
  }
  return positional;
}

std::string FlagSet::Usage() const {
  std::string out = absl::StrCat("Usage: ", program_, " [flags]");
  for (const auto& [name, help] : positional_) absl::StrAppend(&out, " ", name);
  absl::StrAppend(&out, "\n\n", summary_, "\n");
  if (!positional_.empty()) {
    absl::StrAppend(&out, "\nArguments:\n");
    for (const auto& [name, help] : positional_) {
      absl::StrAppend(&out, "  ", name, "\n      ", help, "\n");
    }
  }
  absl::StrAppend(&out, "\nFlags:\n");
  for (const Flag& f : flags_) {
    absl::StrAppend(&out, "  --", f.name, " (", f.type, ", default ", f.default_text, ")\n      ",
                    f.help, "\n");
  }
  absl::StrAppend(&out, "  --help\n      Show this text.\n");
  if (!epilog_.empty()) absl::StrAppend(&out, "\n", epilog_, "\n");
  return out;
}

int FlagSet::ExitCode(const absl::Status& status) {
  if (status.ok() || status.code() == absl::StatusCode::kCancelled) return 0;
  return 2;
}

int FlagSet::Fail(const absl::Status& status) const {
  if (status.code() != absl::StatusCode::kCancelled) {
    std::cerr << program_ << ": " << status.message() << "\n"
              << "Run '" << program_ << " --help' for usage.\n";
  }
  return ExitCode(status);
}

size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t prev = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cur = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, prev + (a[i - 1] != b[j - 1])});
      prev = cur;
    }
  }
  return row[b.size()];
}

std::string ClosestMatch(absl::string_view word, const std::vector<std::string>& candidates,
                         size_t max_distance) {
  if (word.size() > kMaxMatchBytes) return "";
  const std::string* best = nullptr;
  size_t best_distance = max_distance + 1;
  for (const std::string& c : candidates) {
    if (c == word) return "";
    const size_t d = EditDistance(word, c);
    if (d < best_distance) {
      best_distance = d;
      best = &c;
    }
  }
  return best == nullptr ? "" : *best;
}

absl::Status CheckFlagRange(absl::string_view name, int64_t value, int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", name, ": ", value, " is not in [", lo, ", ", hi, "]"));
}

absl::Status CheckFlagRange(absl::string_view name, absl::Duration value, absl::Duration lo,
                            absl::Duration hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", absl::FormatDuration(value),
                                                 " is not in [", absl::FormatDuration(lo), ", ",
                                                 absl::FormatDuration(hi), "]"));
}

absl::Status CheckFlagNotNegative(absl::string_view name, int64_t value) {
  if (value >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", value, " is negative"));
}

absl::Status CheckFlagNotNegative(absl::string_view name, absl::Duration value) {
  if (value >= absl::ZeroDuration()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", name, ": ", absl::FormatDuration(value), " is negative"));
}

}  // namespace detour
