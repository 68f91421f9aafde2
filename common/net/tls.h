// Transport security for every detour gRPC server and channel, built in one
// place: TLS with a cluster CA (the coordinator and workers present
// certificates from it, and verify their peers' against it), or plaintext
// when --insecure was asked for explicitly. Also the flags that choose it
// (--tls_cert, --tls_key, --tls_ca, --insecure) and reading a peer's verified
// identity from a call.
#ifndef DETOUR_COMMON_NET_TLS_H_
#define DETOUR_COMMON_NET_TLS_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/flags.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/auth_context.h"

// OpenSSL's types, without its headers.
struct ssl_ctx_st;
struct ssl_st;

namespace detour {

// Paths as given on a command line.
struct TlsFiles {
  std::string cert;  // PEM certificate (chain) presented to peers
  std::string key;   // PEM private key of `cert`
  std::string ca;    // PEM bundle that peers' certificates must chain to
  bool insecure = false;
  // Accept certificates without an identity kind (identity.h) as workers'
  // (--allow_unmarked_worker_certs, coordinator and workers).
  bool allow_unmarked_worker_certs = false;
};

// Loaded and checked credentials. Immutable after Load; copyable and
// thread-safe (copies share the PEM text).
class TransportSecurity {
 public:
  // Plaintext, unauthenticated.
  static TransportSecurity Insecure();

  // Reads and checks the files. Servers (coordinator, workers) need all three;
  // a client (`client` = true) needs --tls_ca, and --tls_cert/--tls_key only
  // together. Errors name the flag and file: missing or unreadable file, no
  // PEM certificate or key in it, a key that does not match the certificate,
  // a certificate that does not chain to --tls_ca or has expired. With
  // `insecure`, any TLS file given is an error (the two contradict).
  static absl::StatusOr<TransportSecurity> Load(const TlsFiles& files, bool client);

  bool tls() const { return material_ != nullptr; }
  // The common name (CN) of this process's own certificate; "" without one.
  const std::string& name() const;
  // Whether peers' certificates without an identity kind count as workers'.
  bool allow_unmarked_worker_certs() const;
  // OK when this process's own certificate may act as a worker's
  // (identity.h), or without TLS; PERMISSION_DENIED saying why not.
  absl::Status CheckOwnWorkerCertificate() const;

  // Server side: TLS presenting our certificate; a client certificate is
  // requested and, when given, must verify against the CA (clients with a
  // bearer token need none).
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  // Client side: verifies the server against the CA and presents our
  // certificate when we have one.
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;

  // An OpenSSL context for detour's own TLS connections (the direct tensor
  // transport, worker/transport/direct_link.h): presents our certificate and
  // requires the peer's, verified against the CA, both ways (a server refuses
  // a client without a certificate). TLS 1.2 or newer. FAILED_PRECONDITION
  // without TLS or without our own certificate.
  absl::StatusOr<std::shared_ptr<ssl_ctx_st>> NewSslContext(bool server) const;

  // "plaintext (--insecure)" or "TLS as CN=... (CA ...)" for start-up logs.
  std::string Describe() const;

 private:
  struct Material {
    std::string cert_pem, key_pem, ca_pem;
    std::string name;
    std::string ca_path;
    bool allow_unmarked_worker_certs = false;
  };
  std::shared_ptr<const Material> material_;
};

// Declares --tls_cert, --tls_key, --tls_ca and --insecure on `flags`.
void RegisterTlsFlags(FlagSet* flags, TlsFiles* files);
// Declares --allow_unmarked_worker_certs (the coordinator and workers).
void RegisterWorkerIdentityFlags(FlagSet* flags, TlsFiles* files);

// The daemons' rule: TLS files, or an explicit --insecure; neither is an
// error that says so (INVALID_ARGUMENT, exit 2).
absl::StatusOr<TransportSecurity> LoadDaemonSecurity(const TlsFiles& files);

// The peer's identity: the CN of the certificate it presented, when that
// certificate was verified against our CA; nullopt for plaintext calls and
// TLS clients without a certificate.
std::optional<std::string> VerifiedPeerName(const grpc::AuthContext* auth);

// The same for an established OpenSSL connection made with NewSslContext.
std::optional<std::string> VerifiedPeerName(const ssl_st* ssl);

// Whether `name` could be a certificate-derived identity we accept (worker
// ids, client names): 1..128 characters of [A-Za-z0-9._-].
bool ValidIdentityName(absl::string_view name);

}  // namespace detour

#endif  // DETOUR_COMMON_NET_TLS_H_
