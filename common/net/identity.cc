#include "common/net/identity.h"

#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <memory>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/net/openssl_ptr.h"

namespace detour {
namespace {

constexpr absl::string_view kScheme = "detour://";
// subjectAltNames looked at; a worker's certificate has a handful.
constexpr int kMaxAltNames = 256;

using openssl::Cert;

std::string CommonNameOf(X509* cert) {
  X509_NAME* subject = X509_get_subject_name(cert);
  const int index = X509_NAME_get_index_by_NID(subject, NID_commonName, -1);
  if (index < 0) return "";
  ASN1_STRING* data = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, index));
  const unsigned char* bytes = ASN1_STRING_get0_data(data);
  const int length = ASN1_STRING_length(data);
  if (bytes == nullptr || length <= 0) return "";
  return std::string(reinterpret_cast<const char*>(bytes), static_cast<size_t>(length));
}

absl::StatusOr<CertificateIdentity> IdentityOf(X509* cert) {
  CertificateIdentity identity;
  identity.name = CommonNameOf(cert);
  const std::string shown = absl::CHexEscape(identity.name.substr(0, 128));
  openssl::GeneralNames names(
      static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr)));
  std::vector<std::string> marks;
  const int count = names == nullptr ? 0 : sk_GENERAL_NAME_num(names.get());
  if (count > kMaxAltNames) {
    return absl::PermissionDeniedError(absl::StrCat("certificate CN=", shown, " has ", count,
                                                    " subjectAltNames, more than ", kMaxAltNames));
  }
  for (int i = 0; i < count; ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names.get(), i);
    if (name->type != GEN_URI) continue;
    const unsigned char* bytes = ASN1_STRING_get0_data(name->d.uniformResourceIdentifier);
    const int length = ASN1_STRING_length(name->d.uniformResourceIdentifier);
    if (bytes == nullptr || length <= 0) continue;
    std::string uri(reinterpret_cast<const char*>(bytes), static_cast<size_t>(length));
    if (absl::StartsWithIgnoreCase(uri, kScheme)) marks.push_back(std::move(uri));
  }
  if (marks.empty()) return identity;
  if (marks.size() > 1) {
    return absl::PermissionDeniedError(
        absl::StrCat("certificate CN=", shown, " is marked with ", marks.size(), " identities (",
                     absl::CHexEscape(absl::StrJoin(marks, ", ").substr(0, 512)),
                     "); a certificate may have one kind"));
  }
  identity.uri = marks[0];
  const absl::string_view rest = absl::string_view(identity.uri).substr(kScheme.size());
  const size_t slash = rest.find('/');
  const absl::string_view kind = rest.substr(0, slash);
  const absl::string_view named = slash == absl::string_view::npos ? "" : rest.substr(slash + 1);
  if (kind == "worker") {
    identity.kind = IdentityKind::kWorker;
  } else if (kind == "coordinator") {
    identity.kind = IdentityKind::kCoordinator;
  } else if (kind == "client") {
    identity.kind = IdentityKind::kClient;
  } else {
    return absl::PermissionDeniedError(absl::StrCat(
        "certificate CN=", shown, " is marked ", absl::CHexEscape(identity.uri.substr(0, 256)),
        ", an unknown identity kind (worker, coordinator or client)"));
  }
  if (named != identity.name) {
    return absl::PermissionDeniedError(absl::StrCat("certificate CN=", shown, " is marked ",
                                                    absl::CHexEscape(identity.uri.substr(0, 256)),
                                                    ", which names another identity than its CN"));
  }
  return identity;
}

}  // namespace

const char* IdentityKindName(IdentityKind kind) {
  switch (kind) {
    case IdentityKind::kUnmarked: return "unmarked";
    case IdentityKind::kWorker: return "worker";
    case IdentityKind::kCoordinator: return "coordinator";
    case IdentityKind::kClient: return "client";
  }
  return "unknown";
}

absl::StatusOr<CertificateIdentity> ReadCertificateIdentity(absl::string_view pem) {
  openssl::Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  Cert cert(bio == nullptr ? nullptr : PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr) return absl::InvalidArgumentError("no PEM certificate");
  return IdentityOf(cert.get());
}

absl::Status CheckWorkerIdentity(const CertificateIdentity& identity, bool allow_unmarked) {
  const std::string shown = absl::CHexEscape(identity.name.substr(0, 128));
  switch (identity.kind) {
    case IdentityKind::kWorker: return absl::OkStatus();
    case IdentityKind::kUnmarked:
      if (allow_unmarked) return absl::OkStatus();
      return absl::PermissionDeniedError(absl::StrCat(
          "certificate CN=", shown,
          " is not marked as a worker's (it has no subjectAltName URI detour://worker/", shown,
          "; certificates made before identity kinds have none): regenerate it with "
          "tools/gen_certs.sh DIR --worker ",
          shown,
          ", or run the coordinator and the workers with --allow_unmarked_worker_certs "
          "until every worker has a marked one"));
    case IdentityKind::kCoordinator:
    case IdentityKind::kClient:
      return absl::PermissionDeniedError(
          absl::StrCat("certificate CN=", shown, " is a ", IdentityKindName(identity.kind),
                       "'s (subjectAltName URI ", absl::CHexEscape(identity.uri.substr(0, 256)),
                       "), not a worker's: a worker needs one marked detour://worker/NAME "
                       "(tools/gen_certs.sh --worker)"));
  }
  return absl::PermissionDeniedError("unknown identity kind");
}

absl::Status CheckWorkerCertificatePem(absl::string_view pem, bool allow_unmarked) {
  absl::StatusOr<CertificateIdentity> identity = ReadCertificateIdentity(pem);
  if (!identity.ok()) return identity.status();
  return CheckWorkerIdentity(*identity, allow_unmarked);
}

absl::Status CheckWorkerPeer(const grpc::AuthContext* auth, bool allow_unmarked) {
  if (auth == nullptr || !auth->IsPeerAuthenticated()) {
    return absl::UnauthenticatedError("no verified certificate");
  }
  std::vector<grpc::string_ref> pems = auth->FindPropertyValues("x509_pem_cert");
  if (pems.size() != 1) return absl::UnauthenticatedError("no verified certificate");
  return CheckWorkerCertificatePem(absl::string_view(pems[0].data(), pems[0].size()),
                                   allow_unmarked);
}

absl::Status CheckWorkerPeer(const ssl_st* ssl, bool allow_unmarked) {
  if (ssl == nullptr || SSL_get_verify_result(ssl) != X509_V_OK) {
    return absl::UnauthenticatedError("no verified certificate");
  }
  Cert peer(SSL_get1_peer_certificate(ssl));
  if (peer == nullptr) return absl::UnauthenticatedError("no verified certificate");
  absl::StatusOr<CertificateIdentity> identity = IdentityOf(peer.get());
  if (!identity.ok()) return identity.status();
  return CheckWorkerIdentity(*identity, allow_unmarked);
}

}  // namespace detour
