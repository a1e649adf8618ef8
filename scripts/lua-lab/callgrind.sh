#!/bin/bash
# Instructions a redis-server under callgrind spends on recorded calls (lab.py), per variant:
# deterministic where timings on a shared machine are not. Usage: callgrind.sh CALLS PORT VARIANT...
# Subtract a variant that only returns (`return 0`) to leave the process's own start and stop.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
calls=$1 port=$2
shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for variant in "$@"; do
  valgrind --tool=callgrind --callgrind-out-file="$work/out" \
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no > "$work/log" 2>&1 &
  server=$!
  for _ in $(seq 1 100); do redis-cli -p "$port" ping > /dev/null 2>&1 && break; sleep 0.2; done
  ROUNDS=1 python3 "$here/lab.py" run "$calls" "$port" "$variant" > /dev/null
  redis-cli -p "$port" shutdown nosave > /dev/null 2>&1 || true
  wait "$server" || true
  echo "$variant $(grep -h '^summary:' "$work/out") instructions"
done
