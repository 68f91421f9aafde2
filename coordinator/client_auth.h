// Who may call the coordinator's client RPCs (JobService, ListWorkers):
// bearer tokens from an --auth_tokens file, or verified client certificates,
// each with a role. `read` may Get, List, Watch and list workers; `submit`
// may also Submit, and Cancel and Resume the jobs it owns; `admin` may also
// Cancel and Resume anyone's jobs. A caller is known by its token's NAME or
// its certificate's CN (the owner of the jobs it submits). Immutable after
// construction, so thread-safe; the RPC handlers call Check or Identify
// first.
#ifndef DETOUR_COORDINATOR_CLIENT_AUTH_H_
#define DETOUR_COORDINATOR_CLIENT_AUTH_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/net/identity.h"
#include "grpcpp/grpcpp.h"

namespace detour {

enum class ClientRole { kRead = 1, kSubmit = 2, kAdmin = 3 };

// "read", "submit" or "admin".
const char* ClientRoleName(ClientRole role);

// Who made a call, as far as its credentials say.
struct Caller {
  // The token's NAME, else the verified certificate's CN; "" for a token
  // without a name and for a plaintext caller in open mode. At most
  // kMaxCallerNameBytes of [A-Za-z0-9._-] (common/net/tls.h).
  std::string name;
  ClientRole role = ClientRole::kRead;

  // The name, or "an unnamed caller", for logs and events.
  std::string Describe() const;
  // May act on a job owned by `owner`: an admin always; others when they
  // own it, or when the job has no owner (submitted by an unnamed caller,
  // or before jobs had owners).
  bool MayManage(absl::string_view owner) const;
};
inline constexpr size_t kMaxCallerNameBytes = 128;

struct TokenEntry {
  std::string token;
  ClientRole role = ClientRole::kRead;
  std::string name;  // optional; also the CN of client certificates given this role
};

// Parses an --auth_tokens file: one `TOKEN ROLE [NAME]` per line, `#`
// comments and blank lines ignored. Tokens are 16..512 printable characters
// without spaces and unique; roles `read`, `submit` or `admin`; names 1..128 of
// [A-Za-z0-9._-], unique. At most 1 MiB and 10000 entries. Errors name the
// file and line.
absl::StatusOr<std::vector<TokenEntry>> ParseTokens(absl::string_view text, absl::string_view path);
// Reads and parses the file. PERMISSION_DENIED when this user owns it and
// others may read or change it (CheckPrivateFile: mode & 077), naming the
// mode and the chmod that fixes it.
absl::StatusOr<std::vector<TokenEntry>> LoadTokensFile(const std::string& path);

class ClientAuthorizer {
 public:
  // How clients prove who they are.
  enum class Mode {
    kOpen,          // --insecure without --auth_tokens: everyone may do everything
    kTokens,        // --auth_tokens: a listed token, or a certificate whose CN is a listed NAME
    kCertificates,  // TLS without --auth_tokens: any client certificate from the CA is `submit`
  };
  ClientAuthorizer(Mode mode, std::vector<TokenEntry> tokens);

  Mode mode() const { return mode_; }

  // The call's credentials allow `needed` for `method` (named in errors):
  // UNAUTHENTICATED without credentials or with an unknown token,
  // PERMISSION_DENIED for a role below `needed`.
  absl::Status Check(const grpc::CallbackServerContext& context, ClientRole needed,
                     absl::string_view method) const;

  // The same decision without gRPC types: `authorization` is the metadata
  // value when there was one, `peer_name` the verified certificate CN and
  // `peer_kind` its identity kind (common/net/identity.h). A certificate
  // gives a role only when it is a client's (or unmarked, made before
  // kinds): a worker's or the coordinator's is PERMISSION_DENIED, naming
  // what it is — a worker's key on a compromised host cannot submit or
  // cancel jobs. With a bearer token the token decides.
  absl::Status Authorize(std::optional<absl::string_view> authorization,
                         const std::optional<std::string>& peer_name, ClientRole needed,
                         absl::string_view method,
                         IdentityKind peer_kind = IdentityKind::kClient) const;

  // Check, and who the caller is. In open mode everyone is an admin, named
  // by its certificate when it has one.
  absl::StatusOr<Caller> Identify(const grpc::CallbackServerContext& context, ClientRole needed,
                                  absl::string_view method) const;
  absl::StatusOr<Caller> Identify(std::optional<absl::string_view> authorization,
                                  const std::optional<std::string>& peer_name, ClientRole needed,
                                  absl::string_view method,
                                  IdentityKind peer_kind = IdentityKind::kClient) const;

 private:
  const TokenEntry* FindToken(absl::string_view token) const;

  Mode mode_;
  std::vector<TokenEntry> tokens_;
};

// Equal contents, in time that depends only on the lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace detour

#endif  // DETOUR_COORDINATOR_CLIENT_AUTH_H_
