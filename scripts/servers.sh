#!/usr/bin/env bash
# Builds server source archives (Redis, Valkey) once each into
# target/servers/NAME/bin (as redis-server and redis-cli, which the tests
# look for) and prints each server binary's path.
#
#   scripts/servers.sh NAME...     NAME: an archive's name without .tar.gz,
#                                  e.g. redis-6.2.16 or valkey-8.0.1
#
# Archives are read from $REDMUTEX_SERVER_ARCHIVES (default ../shared/servers,
# beside the repository) and checked against its SHA256SUMS when there is
# one. Built without TLS and with libc's malloc: `make BUILD_TLS=no
# MALLOC=libc` (16-60 s each on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
archives=${REDMUTEX_SERVER_ARCHIVES:-../shared/servers}
cache=target/servers
if [ $# -eq 0 ]; then
  echo "usage: scripts/servers.sh NAME..." >&2
  exit 2
fi
for name in "$@"; do
  bin=$cache/$name/bin
  if [ ! -x "$bin/redis-server" ]; then
    archive=$archives/$name.tar.gz
    if [ ! -f "$archive" ]; then
      echo "error: no archive $archive" >&2
      exit 1
    fi
    if [ -f "$archives/SHA256SUMS" ]; then
      (cd "$archives" && grep " $name.tar.gz\$" SHA256SUMS | sha256sum -c --quiet -) >&2
    fi
    work=$(mktemp -d)
    tar xzf "$archive" -C "$work"
    echo "building $name" >&2
    if ! make -C "$work/$name" -j2 BUILD_TLS=no MALLOC=libc > "$work/build.log" 2>&1; then
      tail -30 "$work/build.log" >&2
      echo "error: $name did not build" >&2
      exit 1
    fi
    mkdir -p "$bin"
    for tool in server cli; do
      built=$(ls "$work/$name/src/redis-$tool" "$work/$name/src/valkey-$tool" 2>/dev/null | head -1 || true)
      cp "$built" "$bin/redis-$tool"
    done
    rm -rf "$work"
  fi
  echo "$bin/redis-server"
done
