#!/bin/sh
# Makes a throwaway cluster CA and certificates for detour (tests, the local
# launcher, the demo; not a production PKI):
#
#   tools/gen_certs.sh OUT_DIR KIND NAME[=IP[,IP...]]... [KIND NAME...]...
#
# KIND is --worker, --coordinator or --client and marks the certificates of
# the names after it (up to the next KIND) with the subjectAltName URI
# detour://KIND/NAME: only a worker's certificate may register with the
# coordinator and send tensors to workers (docs/OPERATIONS.md §Security).
# OUT_DIR/ca.crt and ca.key: the CA (made once; reused when already there, so
# names can be added later). For each NAME: OUT_DIR/NAME.crt and NAME.key
# with CN=NAME and subjectAltName DNS:NAME, DNS:localhost, IP:127.0.0.1, the
# kind's URI and every IP after `=` (IPv4 addresses: a daemon reached at
# another address than loopback, as in detour-local --wan's namespaces, is
# verified against them), usable as server and as client certificate. A
# worker's NAME is its worker id; a client's NAME is what --auth_tokens maps
# to a role. Keys are mode 600.
# Needs the `openssl` command (Debian package openssl).
set -eu

usage() {
  echo "usage: $0 OUT_DIR KIND NAME[=IP[,IP...]]... [KIND NAME...]..." >&2
  echo "  KIND: --worker, --coordinator or --client (the kind of the names after it)" >&2
  echo "  NAME: 1..64 characters of letters, digits, '.', '_' and '-'" >&2
  echo "  IP: extra IPv4 subjectAltNames, e.g. w1=10.77.0.2" >&2
  exit 2
}

[ "$#" -ge 2 ] || usage
out=$1
shift
command -v openssl >/dev/null 2>&1 || {
  echo "$0: openssl not found (apt-get install openssl)" >&2
  exit 1
}
kind=
names=0
for arg in "$@"; do
  case "$arg" in
    --worker | --coordinator | --client) kind=${arg#--}; continue ;;
    -*) echo "$0: unknown option \"$arg\"" >&2; usage ;;
  esac
  if [ -z "$kind" ]; then
    echo "$0: give the kind of \"$arg\" first: --worker, --coordinator or --client" >&2
    usage
  fi
  names=$((names + 1))
  name=${arg%%=*}
  case "$arg" in
    *=*)
      ips=${arg#*=}
      case "$ips" in
        "" | *[!0-9.,]* | ,* | *, | *,,*) echo "$0: bad IP list in \"$arg\"" >&2; usage ;;
      esac
      ;;
  esac
  case "$name" in
    "" | ca | *[!A-Za-z0-9._-]*) echo "$0: bad NAME \"$name\"" >&2; usage ;;
  esac
  if [ "${#name}" -gt 64 ]; then
    echo "$0: NAME \"$name\" is longer than 64 characters" >&2
    usage
  fi
done
[ "$names" -gt 0 ] || { echo "$0: no NAME given" >&2; usage; }

umask 077
mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/detour-certs.XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM

if [ ! -s "$out/ca.crt" ] || [ ! -s "$out/ca.key" ]; then
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$work/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$work/ca.key" -sha256 -days 3650 \
    -subj "/O=detour/CN=detour throwaway CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$work/ca.crt"
  mv "$work/ca.key" "$out/ca.key"
  mv "$work/ca.crt" "$out/ca.crt"
fi
chmod 644 "$out/ca.crt"

for arg in "$@"; do
  case "$arg" in
    --worker | --coordinator | --client) kind=${arg#--}; continue ;;
  esac
  name=${arg%%=*}
  sans="DNS:$name,DNS:localhost,IP:127.0.0.1,URI:detour://$kind/$name"
  case "$arg" in
    *=*) sans="$sans,IP:$(echo "${arg#*=}" | sed 's/,/,IP:/g')" ;;
  esac
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$work/$name.key" 2>/dev/null
  openssl req -new -key "$work/$name.key" -subj "/O=detour/CN=$name" -out "$work/$name.csr"
  cat >"$work/$name.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$sans
EOF
  openssl x509 -req -in "$work/$name.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
    -CAcreateserial -CAserial "$work/ca.srl" -sha256 -days 825 \
    -extfile "$work/$name.ext" -out "$work/$name.crt" 2>/dev/null
  mv "$work/$name.key" "$out/$name.key"
  mv "$work/$name.crt" "$out/$name.crt"
  chmod 644 "$out/$name.crt"
done
