#!/usr/bin/env bash
# Quick start 1/2: a demo of the lock against a private redis-server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure-redis-server.sh
cargo run --quiet --release --example demo
