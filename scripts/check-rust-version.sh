#!/usr/bin/env bash
# Fails when a package in the dependency tree declares a newer Rust
# (`rust-version`) than this crate does: the crate's own `rust-version`
# must be true for what it pulls in. Reads `cargo metadata` (the lock file's
# versions, every feature on, every target).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v python3 >/dev/null 2>&1; then
  echo "error: python3 is needed to read cargo metadata" >&2
  exit 1
fi
cargo metadata --format-version 1 --all-features --locked 2>/dev/null | python3 -c '
import json, sys

def key(version):
    parts = [int(p) for p in version.split(".")]
    return parts + [0] * (3 - len(parts))

meta = json.load(sys.stdin)
root = next(p for p in meta["packages"] if p["id"] == meta["resolve"]["root"])
declared = root.get("rust_version")
if not declared:
    sys.exit("error: %s declares no rust-version" % root["name"])
# Only packages this crate can build with: normal, build and dev
# dependencies reachable from it on any target.
nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
seen, todo = set(), [root["id"]]
while todo:
    pid = todo.pop()
    if pid in seen:
        continue
    seen.add(pid)
    todo.extend(d["pkg"] for d in nodes[pid]["deps"])
newer = []
for p in meta["packages"]:
    need = p.get("rust_version")
    if p["id"] in seen and need and key(need) > key(declared):
        newer.append("%s %s needs Rust %s" % (p["name"], p["version"], need))
if newer:
    print("error: %s declares rust-version %s, but:" % (root["name"], declared), file=sys.stderr)
    for line in sorted(newer):
        print("  " + line, file=sys.stderr)
    sys.exit(1)
highest = max((p.get("rust_version") or "0" for p in meta["packages"] if p["id"] in seen), key=key)
print("rust-version %s holds for %d packages (the highest any needs: %s)" % (declared, len(seen), highest))
'
