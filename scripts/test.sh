#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need (idempotent, cached),
# then runs every test. `.ci/run` calls this script.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo not found: install the Rust toolchain (https://rustup.rs) first" >&2
    exit 1
fi

# redis-server (the Redis tests start their own servers on free loopback ports, TLS ones too) and
# openssl (makes their test certificates) and redis-cli (joins test clusters): Debian packages,
# installed only when missing.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -q
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

# A real Kafka-protocol broker for the worker's end-to-end tests: tansu (Apache Kafka itself is
# not installable here), built with in-memory and SQLite storage (the broker-restart test keeps
# its topics in a SQLite file). Built from crates.io once (15-25 minutes), then cached in
# ~/.cache/vigil-tools; the tests find it there (or at $TANSU) and start their own brokers on
# free loopback ports.
TANSU_VERSION=0.6.0
tansu_root="$HOME/.cache/vigil-tools/tansu-$TANSU_VERSION"
tansu_bin="${TANSU:-$tansu_root/bin/tansu}"
if ! "$tansu_bin" --version 2>/dev/null | grep -qx "tansu $TANSU_VERSION"; then
    echo "installing tansu $TANSU_VERSION (first run only; cached in $tansu_root)" >&2
    cargo install tansu --version "$TANSU_VERSION" --features dynostore,libsql --locked --root "$tansu_root"
fi

# One build (the test profile), then every test: unit, property, fixture, CLI, Redis and Kafka
# end-to-end, against the locked dependencies.
cargo test --locked --all-targets
