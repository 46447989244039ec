#!/bin/bash
# Builds Debian's own Abseil source (the version and patches of the installed libabsl-dev, so the
# ABI is the same) with ThreadSanitizer, and installs it under PREFIX. ThreadSanitizer sees a lock
# only where the code taking it is instrumented: with Debian's uninstrumented libabsl, every
# absl::Mutex of ours and of gRPC (which takes Abseil's, GPR_ABSEIL_SYNC) is invisible to it, and
# every guarded access would be reported as a race.
#
# The source comes from Debian's mirror through a private apt source list and state directory,
# so the machine's apt configuration is left as it is. Usage: build_abseil.sh PREFIX
set -euo pipefail
prefix=${1:?usage: build_abseil.sh PREFIX}
# The installed version and this script's own hash: a change to either builds again.
version="$(dpkg-query -W -f='${Version}' libabsl-dev) $(sha256sum "$0" | cut -c1-16)"
if [ -f "$prefix/.version" ] && [ "$(cat "$prefix/.version")" = "$version" ]; then
  echo "instrumented Abseil $version already in $prefix"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/src"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
cat > "$work/sources.list" <<SOURCES
deb-src [signed-by=$keyring] http://deb.debian.org/debian $codename $codename-updates main
deb-src [signed-by=$keyring] http://deb.debian.org/debian-security $codename-security main
SOURCES
# Lists and caches of its own too: apt's package caches under /var/cache/apt stay as they are.
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update -qq
(cd "$work/src" && apt-get "${apt_opts[@]}" source --download-only -qq "abseil=${version%% *}")
dpkg-source -x "$work"/src/abseil_*.dsc "$work/abseil" > /dev/null
# The options of Debian's shared build (debian/rules), with clang and ThreadSanitizer.
CC=clang CXX=clang++ cmake -S "$work/abseil" -B "$work/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DCMAKE_CXX_FLAGS=-fsanitize=thread \
  -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread -DCMAKE_INSTALL_PREFIX="$prefix" > /dev/null
cmake --build "$work/build" -j"${JOBS:-2}" > /dev/null
cmake --install "$work/build" > /dev/null
echo "$version" > "$prefix/.version"
echo "instrumented Abseil $version installed in $prefix"
