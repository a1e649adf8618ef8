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

# Apache Kafka itself for the worker's end-to-end tests and `vigil bench --kafka`: the broker and its
# command-line tools, fetched through Maven from Maven Central (the version is pinned in
# scripts/kafka/pom.xml), needing Java 17 or newer. Fetched once into
# ~/.cache/vigil-tools/kafka-<version>/libs (about 55 MB of jars); the tests find them there and
# start their own single-node KRaft brokers on free loopback ports.
missing=()
command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || missing+=(maven)
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -q
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi
kafka_version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' scripts/kafka/pom.xml)
kafka_libs="$HOME/.cache/vigil-tools/kafka-$kafka_version/libs"
if [ ! -f "$kafka_libs/.complete" ]; then
    echo "fetching Apache Kafka $kafka_version from Maven Central (first run only; cached in $kafka_libs)" >&2
    rm -rf "$kafka_libs.partial"
    mvn -q -B -f scripts/kafka/pom.xml \
        org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$kafka_libs.partial"
    touch "$kafka_libs.partial/.complete"
    rm -rf "$kafka_libs"
    mv "$kafka_libs.partial" "$kafka_libs"
fi

# One build (the test profile), then every test: unit, property, fixture, CLI, Redis and Kafka
# end-to-end, against the locked dependencies.
cargo test --locked --all-targets
