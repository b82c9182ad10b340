#!/usr/bin/env bash
# Quick start 2/2: the whole test suite against private redis-server processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure-redis-server.sh
cargo test --all-features --all-targets
cargo test --all-features --doc
