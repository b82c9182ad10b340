#!/usr/bin/env bash
# Quick start 2/2: the tests, against private redis-server processes.
#
#   scripts/test.sh          the default tier: every lock type, every kind of
#                            deployment, the fault proxy, the CLI, the doc
#                            tests and a short chaos run (a few minutes)
#   scripts/test.sh --full   everything (what CI runs)
#   scripts/test.sh --server NAME
#                            the default tier against another server: a
#                            binary's path, or an archive's name that
#                            scripts/servers.sh builds (redis-6.2.16,
#                            valkey-8.0.1, ...); without the TLS tests
#                            (those builds have no TLS)
set -euo pipefail
cd "$(dirname "$0")/.."

full=
server=
while [ $# -gt 0 ]; do
  case "$1" in
    --full) full=1 ;;
    --server) server=${2:?--server needs a name or a path}; shift ;;
    *) echo "usage: scripts/test.sh [--full] [--server NAME|PATH]" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$server" ]; then
  if [ ! -x "$server" ]; then
    server=$(bash scripts/servers.sh "$server" | tail -1)
  fi
  REDIS_SERVER=$(realpath "$server")
  export REDIS_SERVER
  if [ -x "$(dirname "$REDIS_SERVER")/redis-cli" ]; then
    export REDIS_CLI="$(dirname "$REDIS_SERVER")/redis-cli"
  fi
  echo "testing against $("$REDIS_SERVER" --version)"
else
  bash scripts/ensure-redis-server.sh
fi

# The examples' binaries, which tests/examples.rs runs against private
# servers (`cargo test` builds examples only as test harnesses, elsewhere).
cargo build --all-features --examples

if [ -n "$full" ]; then
  cargo test --all-features --all-targets
  cargo test --all-features --doc
  # Tests too slow to repeat in every tier (the CLI's 30 s default wait).
  cargo test --all-features --test cli -- --ignored
  exit 0
fi

# Whole test files: the lock types and their capabilities, waiting, the watchdog, lost replies
# through the fault proxy, mutual exclusion across processes, the CLI, and
# (against the system's server; the docs and the examples do not change
# with the server) the docs and the copyable examples.
whole=(lock reentrant_lock rwlock semaphore multilock fairlock capabilities status notify watchdog lost_reply exclusion doctor)
if [ -z "$server" ]; then
  # The docs, the examples, the movable guard (the plain lock's lease on
  # another thread) and the CLI's supervisor do not change with the
  # server: against the system's server only. Another server runs the
  # CLI's runs that meet Redis.
  whole+=(movable cli examples docs)
fi
# One test or two of the slow files: a deployment kind each, RedLock, and
# the short chaos run. Each entry: file, then name filters.
picked=(
  "redlock a_majority_is_needed_for_every_subset_of_taken_nodes errors_say_how_many_granted"
  "sentinel min_replicas_is_met_through_sentinel"
  "cluster mutual_exclusion_on_keys_of_every_primary rwlock_reentrant_lock_and_semaphore_work_on_a_cluster"
  "chaos short_chaos"
)
if [ -z "$server" ]; then
  picked+=("tls lock_and_unlock_over_tls the_watchdog_renews_over_tls")
else
  picked+=("cli two_racing_runs_take_turns_and_no_wait_gives_up the_childs_exit_code_and_environment_pass_through status_json_parses_and_release_is_owner_checked run_with_keys_takes_the_set_whole_or_not_at_all a_fair_run_killed_at_the_head_of_the_queue_drops_out")
fi

targets=(--lib)
for t in "${whole[@]}"; do targets+=(--test "$t"); done
for p in "${picked[@]}"; do read -r t _ <<< "$p"; targets+=(--test "$t"); done
# Built together (in parallel), then run.
cargo test --all-features --no-run "${targets[@]}"
cargo test --all-features --lib
for t in "${whole[@]}"; do
  cargo test --all-features --test "$t"
done
for p in "${picked[@]}"; do
  read -r t filters <<< "$p"
  # shellcheck disable=SC2086 # the filters are words
  cargo test --all-features --test "$t" -- $filters
done
cargo test --all-features --doc
