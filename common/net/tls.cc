#include "common/net/tls.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/net/identity.h"
#include "common/net/openssl_ptr.h"
#include "common/status.h"

namespace detour {
namespace {

// A PEM file larger than this is not a certificate bundle we want to parse.
constexpr size_t kMaxPemBytes = size_t{1} << 20;
constexpr size_t kMaxIdentityBytes = 128;

using openssl::Bio;
using openssl::Cert;

// The oldest queued OpenSSL error, for messages; clears the queue.
std::string OpenSslError() {
  unsigned long code = ERR_get_error();
  std::string text;
  if (code != 0) {
    char buffer[256];
    ERR_error_string_n(code, buffer, sizeof(buffer));
    text = buffer;
  }
  ERR_clear_error();
  return text.empty() ? "no detail" : text;
}

absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view flag) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat(flag, ": ", path, " does not exist"));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > kMaxPemBytes) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is ", st.st_size,
                                                   " bytes, more than a PEM file of ", kMaxPemBytes,
                                                   " bytes may be"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::PermissionDeniedError(absl::StrCat(flag, ": cannot read ", path));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(flag, ": error reading ", path));
  return text.str();
}

// Every certificate in `pem`, in order; an error when there is none.
absl::StatusOr<std::vector<Cert>> ParseCertificates(const std::string& pem,
                                                    const std::string& what) {
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  std::vector<Cert> certs;
  while (true) {
    Cert cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
    if (cert == nullptr) break;
    certs.push_back(std::move(cert));
    if (certs.size() > 1000) {
      return absl::InvalidArgumentError(absl::StrCat(what, " holds more than 1000 certificates"));
    }
  }
  ERR_clear_error();  // the end of the input reads as an error
  if (certs.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " holds no PEM certificate (\"-----BEGIN CERTIFICATE-----\")"));
  }
  return certs;
}

std::string CommonName(X509* cert) {
  X509_NAME* subject = X509_get_subject_name(cert);
  const int index = X509_NAME_get_index_by_NID(subject, NID_commonName, -1);
  if (index < 0) return "";
  ASN1_STRING* data = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, index));
  const unsigned char* bytes = ASN1_STRING_get0_data(data);
  const int length = ASN1_STRING_length(data);
  if (bytes == nullptr || length <= 0) return "";
  return std::string(reinterpret_cast<const char*>(bytes), static_cast<size_t>(length));
}

// Checks that `chain` (leaf first) verifies against `roots` now.
absl::Status VerifyChain(const std::vector<Cert>& chain, const std::vector<Cert>& roots,
                         const std::string& what, const std::string& ca_what) {
  openssl::Store store(X509_STORE_new());
  for (const Cert& root : roots) X509_STORE_add_cert(store.get(), root.get());
  openssl::CertStack intermediates(sk_X509_new_null());
  for (size_t i = 1; i < chain.size(); ++i) sk_X509_push(intermediates.get(), chain[i].get());
  openssl::StoreCtx ctx(X509_STORE_CTX_new());
  if (X509_STORE_CTX_init(ctx.get(), store.get(), chain[0].get(), intermediates.get()) != 1) {
    return absl::InternalError(absl::StrCat("cannot check ", what, ": ", OpenSslError()));
  }
  if (X509_verify_cert(ctx.get()) != 1) {
    const int error = X509_STORE_CTX_get_error(ctx.get());
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(what, " does not verify against ", ca_what, ": ",
                                                   X509_verify_cert_error_string(error)));
  }
  return absl::OkStatus();
}

}  // namespace

TransportSecurity TransportSecurity::Insecure() { return TransportSecurity(); }

absl::StatusOr<TransportSecurity> TransportSecurity::Load(const TlsFiles& files, bool client) {
  const bool any = !files.cert.empty() || !files.key.empty() || !files.ca.empty();
  if (files.insecure) {
    if (any) {
      return absl::InvalidArgumentError(
          "--insecure contradicts --tls_cert/--tls_key/--tls_ca: give one or the other");
    }
    return Insecure();
  }
  if (files.ca.empty()) {
    return absl::InvalidArgumentError("--tls_ca: required for TLS (or pass --insecure)");
  }
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (!client && files.cert.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key: required for TLS on a server (or pass --insecure)");
  }
  auto material = std::make_shared<Material>();
  material->ca_path = files.ca;
  material->allow_unmarked_worker_certs = files.allow_unmarked_worker_certs;
  ASSIGN_OR_RETURN(material->ca_pem, ReadPemFile(files.ca, "--tls_ca"));
  ASSIGN_OR_RETURN(std::vector<Cert> roots,
                   ParseCertificates(material->ca_pem, absl::StrCat("--tls_ca: ", files.ca)));
  if (!files.cert.empty()) {
    ASSIGN_OR_RETURN(material->cert_pem, ReadPemFile(files.cert, "--tls_cert"));
    ASSIGN_OR_RETURN(material->key_pem, ReadPemFile(files.key, "--tls_key"));
    const std::string cert_what = absl::StrCat("--tls_cert: ", files.cert);
    ASSIGN_OR_RETURN(std::vector<Cert> chain, ParseCertificates(material->cert_pem, cert_what));
    Bio key_bio(
        BIO_new_mem_buf(material->key_pem.data(), static_cast<int>(material->key_pem.size())));
    openssl::Key key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
    if (key == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("--tls_key: ", files.key,
                                                     " holds no unencrypted PEM private key (",
                                                     OpenSslError(), ")"));
    }
    if (X509_check_private_key(chain[0].get(), key.get()) != 1) {
      ERR_clear_error();
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls_key: ", files.key, " is not the key of the certificate in ", files.cert));
    }
    RETURN_IF_ERROR(VerifyChain(chain, roots, cert_what, absl::StrCat("--tls_ca ", files.ca)));
    material->name = CommonName(chain[0].get());
    if (!ValidIdentityName(material->name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          cert_what, ": the certificate's common name \"", absl::CHexEscape(material->name),
          "\" is not 1..128 characters of letters, digits, '.', '_' and '-'"));
    }
  }
  TransportSecurity security;
  security.material_ = std::move(material);
  return security;
}

const std::string& TransportSecurity::name() const {
  static const std::string* const kEmpty = new std::string();
  return material_ ? material_->name : *kEmpty;
}

bool TransportSecurity::allow_unmarked_worker_certs() const {
  return material_ != nullptr && material_->allow_unmarked_worker_certs;
}

absl::Status TransportSecurity::CheckOwnWorkerCertificate() const {
  if (material_ == nullptr || material_->cert_pem.empty()) return absl::OkStatus();
  return CheckWorkerCertificatePem(material_->cert_pem, material_->allow_unmarked_worker_certs);
}

std::shared_ptr<grpc::ServerCredentials> TransportSecurity::ServerCredentials() const {
  if (!tls()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = material_->ca_pem;
  options.pem_key_cert_pairs.push_back({material_->key_pem, material_->cert_pem});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> TransportSecurity::ChannelCredentials() const {
  if (!tls()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = material_->ca_pem;
  options.pem_private_key = material_->key_pem;
  options.pem_cert_chain = material_->cert_pem;
  return grpc::SslCredentials(options);
}

absl::StatusOr<std::shared_ptr<SSL_CTX>> TransportSecurity::NewSslContext(bool server) const {
  if (!tls() || material_->cert_pem.empty()) {
    return absl::FailedPreconditionError(
        "TLS connections between workers need TLS with a certificate of our own");
  }
  std::shared_ptr<SSL_CTX> ctx(SSL_CTX_new(server ? TLS_server_method() : TLS_client_method()),
                               SSL_CTX_free);
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("SSL_CTX_new: ", OpenSslError()));
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  // AES-128-GCM first: the fastest of the TLS 1.3 suites with AES-NI (4.3
  // against 3.8 GB/s for AES-256-GCM on one core of the benchmark machine,
  // BENCHMARKS.md §Transport), and the cipher bounds a TLS tensor link.
  if (SSL_CTX_set_ciphersuites(ctx.get(),
                               "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:"
                               "TLS_CHACHA20_POLY1305_SHA256") != 1) {
    return absl::InternalError(absl::StrCat("SSL_CTX_set_ciphersuites: ", OpenSslError()));
  }
  // No read-ahead: OpenSSL moves what it read ahead to the front of its
  // buffer before every record (to align the payload); with a 256 KiB
  // read-ahead buffer memmove took 23 % of a loopback TLS transfer's CPU
  // (12 % without), and reading each record with two system calls is 4-9 %
  // faster for 16 and 64 MiB tensors, the same within noise for 1 and 4 MiB
  // (BENCHMARKS.md §Transport).
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_AUTO_RETRY);
  ASSIGN_OR_RETURN(std::vector<Cert> chain, ParseCertificates(material_->cert_pem, "certificate"));
  if (SSL_CTX_use_certificate(ctx.get(), chain[0].get()) != 1) {
    return absl::InternalError(absl::StrCat("SSL_CTX_use_certificate: ", OpenSslError()));
  }
  for (size_t i = 1; i < chain.size(); ++i) {
    if (SSL_CTX_add1_chain_cert(ctx.get(), chain[i].get()) != 1) {
      return absl::InternalError(absl::StrCat("SSL_CTX_add1_chain_cert: ", OpenSslError()));
    }
  }
  Bio key_bio(
      BIO_new_mem_buf(material_->key_pem.data(), static_cast<int>(material_->key_pem.size())));
  openssl::Key key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr || SSL_CTX_use_PrivateKey(ctx.get(), key.get()) != 1 ||
      SSL_CTX_check_private_key(ctx.get()) != 1) {
    return absl::InternalError(absl::StrCat("private key: ", OpenSslError()));
  }
  ASSIGN_OR_RETURN(std::vector<Cert> roots, ParseCertificates(material_->ca_pem, "CA bundle"));
  X509_STORE* store = SSL_CTX_get_cert_store(ctx.get());
  for (const Cert& root : roots) {
    if (X509_STORE_add_cert(store, root.get()) != 1) {
      return absl::InternalError(absl::StrCat("CA certificate: ", OpenSslError()));
    }
  }
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  return ctx;
}

std::string TransportSecurity::Describe() const {
  if (!tls()) return "plaintext (--insecure)";
  return absl::StrCat("TLS", material_->name.empty() ? "" : absl::StrCat(" as ", material_->name),
                      " (CA ", material_->ca_path, ")");
}

void RegisterTlsFlags(FlagSet* flags, TlsFiles* files) {
  flags->String("tls_cert", &files->cert, "PEM certificate this process presents (TLS)");
  flags->String("tls_key", &files->key, "PEM private key of --tls_cert");
  flags->String("tls_ca", &files->ca, "PEM CA bundle that peers' certificates must chain to");
  flags->Bool("insecure", &files->insecure,
              "plaintext gRPC without authentication (only on a trusted network)");
}

void RegisterWorkerIdentityFlags(FlagSet* flags, TlsFiles* files) {
  flags->Bool("allow_unmarked_worker_certs", &files->allow_unmarked_worker_certs,
              "accept certificates without an identity kind (made before tools/gen_certs.sh "
              "marked kinds) as workers' (a migration aid; docs/OPERATIONS.md §Security)");
}

absl::StatusOr<TransportSecurity> LoadDaemonSecurity(const TlsFiles& files) {
  if (!files.insecure && files.cert.empty() && files.key.empty() && files.ca.empty()) {
    return absl::InvalidArgumentError(
        "no TLS: give --tls_cert, --tls_key and --tls_ca (tools/gen_certs.sh makes a test "
        "CA), or --insecure to run plaintext and unauthenticated on purpose");
  }
  return TransportSecurity::Load(files, /*client=*/false);
}

std::optional<std::string> VerifiedPeerName(const grpc::AuthContext* auth) {
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return std::nullopt;
  std::vector<grpc::string_ref> names = auth->FindPropertyValues("x509_common_name");
  if (names.size() != 1) return std::nullopt;
  std::string name(names[0].data(), names[0].size());
  if (!ValidIdentityName(name)) return std::nullopt;
  return name;
}

std::optional<std::string> VerifiedPeerName(const ssl_st* ssl) {
  if (ssl == nullptr || SSL_get_verify_result(ssl) != X509_V_OK) return std::nullopt;
  Cert peer(SSL_get1_peer_certificate(ssl));
  if (peer == nullptr) return std::nullopt;
  std::string name = CommonName(peer.get());
  if (!ValidIdentityName(name)) return std::nullopt;
  return name;
}

bool ValidIdentityName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxIdentityBytes) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-';
  });
}

}  // namespace detour
