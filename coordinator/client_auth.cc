#include "coordinator/client_auth.h"

#include <sys/stat.h>

#include <algorithm>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/files.h"
#include "common/net/tls.h"

namespace detour {
namespace {

constexpr size_t kMaxTokensFileBytes = size_t{1} << 20;
constexpr size_t kMaxTokens = 10000;
constexpr size_t kMinTokenBytes = 16;
constexpr size_t kMaxTokenBytes = 512;
constexpr absl::string_view kBearer = "bearer ";

bool ValidToken(absl::string_view token) {
  return std::all_of(token.begin(), token.end(), [](char c) { return c > ' ' && c < 127; });
}

}  // namespace

const char* ClientRoleName(ClientRole role) {
  switch (role) {
    case ClientRole::kRead: return "read";
    case ClientRole::kSubmit: return "submit";
    case ClientRole::kAdmin: return "admin";
  }
  return "unknown";
}

std::string Caller::Describe() const { return name.empty() ? "an unnamed caller" : name; }

bool Caller::MayManage(absl::string_view owner) const {
  return role == ClientRole::kAdmin || owner.empty() || owner == name;
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Every byte of the longer string is looked at whatever the contents.
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

absl::StatusOr<std::vector<TokenEntry>> ParseTokens(absl::string_view text,
                                                    absl::string_view path) {
  if (text.size() > kMaxTokensFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--auth_tokens: ", path, " is ", text.size(),
                                                   " bytes, more than ", kMaxTokensFileBytes));
  }
  std::vector<TokenEntry> entries;
  std::set<std::string> names;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    auto where = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_tokens: ", path, " line ", line_number, ": ", what));
    };
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() < 2 || fields.size() > 3) {
      return where(absl::StrCat("expected TOKEN ROLE [NAME], found ", fields.size(), " field(s)"));
    }
    TokenEntry entry;
    if (fields[0].size() < kMinTokenBytes || fields[0].size() > kMaxTokenBytes) {
      return where(absl::StrCat("the token is ", fields[0].size(), " characters; tokens are ",
                                kMinTokenBytes, "..", kMaxTokenBytes));
    }
    if (!ValidToken(fields[0])) return where("the token has non-printable characters");
    entry.token = std::string(fields[0]);
    if (fields[1] == "read") {
      entry.role = ClientRole::kRead;
    } else if (fields[1] == "submit") {
      entry.role = ClientRole::kSubmit;
    } else if (fields[1] == "admin") {
      entry.role = ClientRole::kAdmin;
    } else {
      return where(absl::StrCat("role \"", absl::CHexEscape(fields[1].substr(0, 32)),
                                "\" is not read, submit or admin"));
    }
    if (fields.size() == 3) {
      if (!ValidIdentityName(fields[2])) {
        return where("the name is not 1..128 characters of letters, digits, '.', '_' and '-'");
      }
      entry.name = std::string(fields[2]);
      if (!names.insert(entry.name).second) {
        return where(absl::StrCat("name ", entry.name, " is listed twice"));
      }
    }
    for (const TokenEntry& other : entries) {
      if (ConstantTimeEquals(other.token, entry.token)) {
        return where("this token is listed on an earlier line too");
      }
    }
    if (entries.size() >= kMaxTokens) {
      return where(absl::StrCat("more than ", kMaxTokens, " tokens"));
    }
    entries.push_back(std::move(entry));
  }
  if (entries.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--auth_tokens: ", path, " lists no token"));
  }
  return entries;
}

absl::StatusOr<std::vector<TokenEntry>> LoadTokensFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("--auth_tokens: ", path, " does not exist"));
  }
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) > kMaxTokensFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--auth_tokens: ", path,
                                                   " is not a regular file of at most ",
                                                   kMaxTokensFileBytes, " bytes"));
  }
  // Every client's secret: refused when others may read it, as ssh refuses
  // such keys.
  if (absl::Status s = CheckPrivateFile(path, "--auth_tokens"); !s.ok()) return s;
  auto text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::PermissionDeniedError(absl::StrCat("--auth_tokens: ", text.status().message()));
  }
  return ParseTokens(*text, path);
}

ClientAuthorizer::ClientAuthorizer(Mode mode, std::vector<TokenEntry> tokens)
    : mode_(mode), tokens_(std::move(tokens)) {}

const TokenEntry* ClientAuthorizer::FindToken(absl::string_view token) const {
  // Compares with every entry, so the time does not say which one matched.
  const TokenEntry* found = nullptr;
  for (const TokenEntry& entry : tokens_) {
    if (ConstantTimeEquals(entry.token, token) && found == nullptr) found = &entry;
  }
  return found;
}

absl::Status ClientAuthorizer::Check(const grpc::CallbackServerContext& context, ClientRole needed,
                                     absl::string_view method) const {
  if (mode_ == Mode::kOpen) return absl::OkStatus();
  return Identify(context, needed, method).status();
}

absl::Status ClientAuthorizer::Authorize(std::optional<absl::string_view> authorization,
                                         const std::optional<std::string>& peer_name,
                                         ClientRole needed, absl::string_view method,
                                         IdentityKind peer_kind) const {
  return Identify(authorization, peer_name, needed, method, peer_kind).status();
}

absl::StatusOr<Caller> ClientAuthorizer::Identify(const grpc::CallbackServerContext& context,
                                                  ClientRole needed,
                                                  absl::string_view method) const {
  std::optional<absl::string_view> authorization;
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it != metadata.end()) authorization = absl::string_view(it->second.data(), it->second.size());
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  const std::optional<std::string> peer_name = VerifiedPeerName(auth.get());
  IdentityKind kind = IdentityKind::kUnmarked;
  if (peer_name.has_value()) {
    // The verified certificate's kind; one whose marking cannot be trusted
    // (common/net/identity.h) counts as nobody's client.
    const std::vector<grpc::string_ref> pems = auth->FindPropertyValues("x509_pem_cert");
    kind = IdentityKind::kWorker;
    if (pems.size() == 1) {
      auto identity = ReadCertificateIdentity(absl::string_view(pems[0].data(), pems[0].size()));
      if (identity.ok()) kind = identity->kind;
    }
  }
  return Identify(authorization, peer_name, needed, method, kind);
}

absl::StatusOr<Caller> ClientAuthorizer::Identify(std::optional<absl::string_view> authorization,
                                                  const std::optional<std::string>& peer_name,
                                                  ClientRole needed, absl::string_view method,
                                                  IdentityKind peer_kind) const {
  // A certificate's CN passed verification; still bounded like a name.
  const bool named_peer = peer_name.has_value() && ValidIdentityName(*peer_name) &&
                          peer_name->size() <= kMaxCallerNameBytes;
  if (mode_ == Mode::kOpen) {
    return Caller{named_peer ? *peer_name : "", ClientRole::kAdmin};
  }
  ClientRole role;
  std::string who;
  std::string name;
  if (authorization.has_value()) {
    absl::string_view value = *authorization;
    if (value.size() > kBearer.size() + kMaxTokenBytes ||
        !absl::StartsWithIgnoreCase(value, kBearer)) {
      return absl::UnauthenticatedError(
          absl::StrCat(method, ": the authorization metadata is not \"Bearer <token>\""));
    }
    const TokenEntry* entry = FindToken(value.substr(kBearer.size()));
    if (entry == nullptr) {
      return absl::UnauthenticatedError(absl::StrCat(method, ": unknown token"));
    }
    role = entry->role;
    who = entry->name.empty() ? "the token" : absl::StrCat("token ", entry->name);
    name = entry->name;
  } else if (peer_name.has_value() && peer_kind != IdentityKind::kClient &&
             peer_kind != IdentityKind::kUnmarked) {
    return absl::PermissionDeniedError(
        absl::StrCat(method, ": certificate CN=", *peer_name, " is a ", IdentityKindName(peer_kind),
                     "'s, not a client's: clients present one marked detour://client/NAME "
                     "(tools/gen_certs.sh --client NAME) or a bearer token"));
  } else if (peer_name.has_value() && mode_ == Mode::kCertificates) {
    role = ClientRole::kSubmit;
    who = absl::StrCat("certificate ", *peer_name);
    if (named_peer) name = *peer_name;
  } else if (peer_name.has_value()) {
    auto entry = std::find_if(tokens_.begin(), tokens_.end(),
                              [&](const TokenEntry& e) { return e.name == *peer_name; });
    if (entry == tokens_.end()) {
      return absl::PermissionDeniedError(absl::StrCat(
          method, ": certificate ", *peer_name, " has no role (no --auth_tokens line names it)"));
    }
    role = entry->role;
    who = absl::StrCat("certificate ", *peer_name);
    name = entry->name;
  } else {
    return absl::UnauthenticatedError(
        absl::StrCat(method,
                     " needs credentials: a bearer token (detourctl --token_file or DETOUR_TOKEN) "
                     "or a client certificate"));
  }
  if (static_cast<int>(role) < static_cast<int>(needed)) {
    return absl::PermissionDeniedError(absl::StrCat(method, ": ", who, " has role ",
                                                    ClientRoleName(role), "; ", method, " needs ",
                                                    ClientRoleName(needed)));
  }
  return Caller{std::move(name), role};
}

}  // namespace detour
