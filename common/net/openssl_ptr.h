// Owners for the OpenSSL objects common/net parses certificates and keys
// with: std::unique_ptr with the matching *_free. Internal to common/net.
#ifndef DETOUR_COMMON_NET_OPENSSL_PTR_H_
#define DETOUR_COMMON_NET_OPENSSL_PTR_H_

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

#include <memory>

namespace detour {
namespace openssl {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
struct StackFree {  // the stack only, not the certificates in it
  void operator()(STACK_OF(X509) * s) const { sk_X509_free(s); }
};
struct NamesFree {
  void operator()(GENERAL_NAMES* n) const { GENERAL_NAMES_free(n); }
};

using Bio = std::unique_ptr<BIO, BioFree>;
using Cert = std::unique_ptr<X509, X509Free>;
using Key = std::unique_ptr<EVP_PKEY, KeyFree>;
using Store = std::unique_ptr<X509_STORE, StoreFree>;
using StoreCtx = std::unique_ptr<X509_STORE_CTX, StoreCtxFree>;
using CertStack = std::unique_ptr<STACK_OF(X509), StackFree>;
using GeneralNames = std::unique_ptr<GENERAL_NAMES, NamesFree>;

}  // namespace openssl
}  // namespace detour

#endif  // DETOUR_COMMON_NET_OPENSSL_PTR_H_
