#!/usr/bin/env bash
# Installs redis-server (Debian/Ubuntu) when it is not on the PATH.
# Tests, benches and examples start their own private redis-server processes
# on free loopback ports; nothing here starts a system service.
set -euo pipefail
# redis-cli (Debian: redis-tools, a dependency of redis-server) builds the
# test clusters.
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
  exit 0
fi
echo "redis-server or redis-cli is missing: installing them with apt-get" >&2
if [ "$(id -u)" -eq 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
elif command -v sudo >/dev/null 2>&1; then
  sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
else
  echo "error: cannot install redis-server (not root, no sudo); install Redis 7 yourself" >&2
  exit 1
fi
# The Debian package starts a system service on port 6379; tests never use it.
command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1
