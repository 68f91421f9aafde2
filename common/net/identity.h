// Identity kinds: what a certificate from the cluster CA is for. The CA signs
// the coordinator's, every worker's and clients' certificates alike, so the
// CA alone does not say who may act as a worker. tools/gen_certs.sh marks each
// certificate with one subjectAltName URI naming its kind and its name (the
// certificate's CN):
//
//   detour://worker/w1          a worker (registers, holds stages, takes frames)
//   detour://coordinator/NAME   the coordinator
//   detour://client/NAME        a user or tool (detourctl, the Python client)
//
// Only a worker's certificate may register with the coordinator, open its
// session, or send tensors to a worker (ActivationService and the direct
// transport). A certificate with no such URI (made before identity kinds)
// is refused too, unless the daemon runs with --allow_unmarked_worker_certs
// (a migration aid). docs/OPERATIONS.md §Security says why a URI.
#ifndef DETOUR_COMMON_NET_IDENTITY_H_
#define DETOUR_COMMON_NET_IDENTITY_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_context.h"

struct ssl_st;

namespace detour {

enum class IdentityKind { kUnmarked, kWorker, kCoordinator, kClient };
// "unmarked", "worker", "coordinator", "client".
const char* IdentityKindName(IdentityKind kind);

// The identity a certificate declares: its CN, its kind, and the URI that
// said so ("" when unmarked).
struct CertificateIdentity {
  std::string name;
  IdentityKind kind = IdentityKind::kUnmarked;
  std::string uri;
};

// Reads the kind of a PEM certificate (the first in `pem`). INVALID_ARGUMENT
// for text without a certificate; PERMISSION_DENIED for a marking that
// cannot be trusted: an unknown kind, a URI naming another name than the CN,
// more than one detour:// URI.
absl::StatusOr<CertificateIdentity> ReadCertificateIdentity(absl::string_view pem);

// Whether a certificate may act as a worker: OK for a worker's, and with
// `allow_unmarked` for one without any kind; otherwise PERMISSION_DENIED
// saying what the certificate is and what to do.
absl::Status CheckWorkerIdentity(const CertificateIdentity& identity, bool allow_unmarked);
absl::Status CheckWorkerCertificatePem(absl::string_view pem, bool allow_unmarked);
// The same for the verified peer of a gRPC call (its "x509_pem_cert") or of
// an OpenSSL connection. UNAUTHENTICATED without a verified certificate.
absl::Status CheckWorkerPeer(const grpc::AuthContext* auth, bool allow_unmarked);
absl::Status CheckWorkerPeer(const ssl_st* ssl, bool allow_unmarked);

}  // namespace detour

#endif  // DETOUR_COMMON_NET_IDENTITY_H_
