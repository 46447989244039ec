#!/bin/sh
# A certificate authority for one cluster and a certificate per host, signed by it, naming the
# host's address (what clients and peers dial) as its subject alternative name:
#   deploy/tls/make_certs.sh DIR controller=10.0.0.1 worker1=10.0.0.2 worker2=10.0.0.3
# writes DIR/ca.pem (give it to every process: --tls-ca), and DIR/NAME.pem and DIR/NAME.key for
# each host (its --tls-cert and --tls-key). An address may be IPv4, IPv6 or a DNS name
# (w1=w1.example.org). Run again with the same DIR to add hosts: it needs DIR/ca.key then. Keep
# ca.key offline otherwise: whoever holds it can make hosts the cluster trusts.
set -eu
if [ $# -lt 2 ]; then
  echo "usage: $0 DIR NAME=ADDRESS..." >&2
  exit 2
fi
dir=$1
shift
for spec in "$@"; do
  name=${spec%%=*}
  address=${spec#*=}
  case "$name" in
    ""|*/*|ca) echo "$0: '$name' cannot name a host (empty, a path, or the authority's own 'ca')" >&2; exit 2 ;;
  esac
  if [ "$name" = "$spec" ] || [ -z "$address" ]; then echo "$0: '$spec' is not NAME=ADDRESS" >&2; exit 2; fi
done
mkdir -p "$dir"
umask 077
if [ ! -f "$dir/ca.pem" ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=pathways cluster CA" \
    -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>"$dir/openssl.log" || { cat "$dir/openssl.log" >&2; exit 1; }
elif [ ! -f "$dir/ca.key" ]; then
  echo "$0: $dir/ca.pem is there but not $dir/ca.key: bring the authority's key back to sign more hosts" >&2
  exit 1
fi
for spec in "$@"; do
  name=${spec%%=*}
  address=${spec#*=}
  case "$address" in
    *:*) san="IP:$address" ;;          # IPv6
    *[!0-9.]*) san="DNS:$address" ;;
    *) san="IP:$address" ;;
  esac
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$san" > "$dir/$name.ext"
  if ! { openssl req -newkey rsa:2048 -nodes -subj "/CN=$address" -keyout "$dir/$name.key" -out "$dir/$name.csr" &&
         openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial -days 365 \
           -extfile "$dir/$name.ext" -out "$dir/$name.pem"; } 2>"$dir/openssl.log"; then
    cat "$dir/openssl.log" >&2
    exit 1
  fi
  rm -f "$dir/$name.csr" "$dir/$name.ext"
done
rm -f "$dir/openssl.log"
chmod 644 "$dir/ca.pem" "$dir"/*.pem
