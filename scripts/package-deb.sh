#!/usr/bin/env bash
# Builds the Debian package of the `redmutex` command: the release binary,
# its man pages and its shell completions (bash, zsh, fish), all generated
# from the one clap definition the binary parses its arguments with.
#
#   scripts/package-deb.sh            build target/deb/redmutex_VERSION-1_ARCH.deb
#   scripts/package-deb.sh --install  build it, install it (dpkg -i, as root),
#                                     check what it installed, and remove it
set -euo pipefail
cd "$(dirname "$0")/.."

install=
case "${1:-}" in
  --install) install=1 ;;
  "") ;;
  *) echo "usage: scripts/package-deb.sh [--install]" >&2; exit 2 ;;
esac

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
cargo build --release --features cli --bin redmutex
binary=target/release/redmutex

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/redmutex
install -Dm755 "$binary" "$root/usr/bin/redmutex"
strip --strip-unneeded "$root/usr/bin/redmutex" 2>/dev/null || true
"$binary" man --dir "$root/usr/share/man/man1"
gzip -9n "$root"/usr/share/man/man1/*.1
"$binary" completions bash | install -Dm644 /dev/stdin "$root/usr/share/bash-completion/completions/redmutex"
"$binary" completions zsh | install -Dm644 /dev/stdin "$root/usr/share/zsh/vendor-completions/_redmutex"
"$binary" completions fish | install -Dm644 /dev/stdin "$root/usr/share/fish/vendor_completions.d/redmutex.fish"
install -Dm644 /dev/null "$root/usr/share/doc/redmutex/copyright"
cat > "$root/usr/share/doc/redmutex/copyright" <<COPYRIGHT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: redmutex
Files: *
License: MIT or Apache-2.0
COPYRIGHT
gzip -9n -c CHANGELOG.md > "$root/usr/share/doc/redmutex/changelog.gz"

# The newest glibc symbol version the binary needs.
glibc=$(objdump -T "$root/usr/bin/redmutex" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -1)
size=$(du -sk "$root/usr" | cut -f1)
mkdir -p "$root/DEBIAN"
cat > "$root/DEBIAN/control" <<CONTROL
Package: redmutex
Version: $version-1
Section: utils
Priority: optional
Architecture: $arch
Depends: libc6 (>= $glibc)
Installed-Size: $size
Maintainer: redmutex maintainers <redmutex@users.noreply.github.com>
Homepage: https://docs.rs/redmutex
Description: flock(1) for a fleet: run a command only while holding a Redis lock
 redmutex run takes a Redis lock (a lease, renewed while the command
 runs), runs the command, and releases it; the command is ended before a
 lost lease can let another host in. Also: status, release, list and a
 deployment doctor.
CONTROL

mkdir -p target/deb
deb=target/deb/redmutex_${version}-1_${arch}.deb
dpkg-deb --build --root-owner-group "$root" "$deb"
dpkg-deb --info "$deb"
dpkg-deb --contents "$deb"

if [ -n "$install" ]; then
  dpkg -i "$deb"
  trap 'dpkg -r redmutex >/dev/null; rm -rf "$stage"' EXIT
  dpkg -s redmutex | grep -E '^(Package|Status|Version):'
  command -v redmutex
  redmutex --version
  man -w redmutex
  man redmutex | grep -q 'flock(1) for a fleet'
  man redmutex-run | grep -q -- '--max-run'
  bash -c 'source /usr/share/bash-completion/completions/redmutex && complete -p redmutex'
  test -s /usr/share/zsh/vendor-completions/_redmutex
  test -s /usr/share/fish/vendor_completions.d/redmutex.fish
  echo "installed and checked: $deb"
fi
