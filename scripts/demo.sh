#!/usr/bin/env bash
# Quick start 1/2: the tour (examples/demo.rs) against a private
# redis-server, listening on a Unix socket in a temporary directory (no TCP
# port, so nothing to pick or collide with) and stopped at the end. To run
# it against a server of your own: REDMUTEX_URL=redis://... cargo run
# --release --example demo
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure-redis-server.sh
# Built before the server starts, so a long first build keeps no server
# waiting.
cargo build --quiet --release --example demo

dir=$(mktemp -d)
server=
stop() {
  if [ -n "$server" ]; then
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
  fi
  rm -rf "$dir"
}
trap stop EXIT
"${REDIS_SERVER:-redis-server}" --port 0 --unixsocket "$dir/redis.sock" \
  --save '' --appendonly no --dir "$dir" >"$dir/log" 2>&1 &
server=$!
for _ in $(seq 100); do
  [ -S "$dir/redis.sock" ] && break
  sleep 0.05
done
if [ ! -S "$dir/redis.sock" ]; then
  echo "error: redis-server did not start within 5 s:" >&2
  cat "$dir/log" >&2
  exit 1
fi
echo "a private redis-server on $dir/redis.sock"
REDMUTEX_URL="unix://$dir/redis.sock" cargo run --quiet --release --example demo
