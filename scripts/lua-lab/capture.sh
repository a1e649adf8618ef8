#!/bin/bash
# Records the commands a replay sends to Redis (MONITOR), to replay its script calls against
# variants of a script with lab.py. Usage: capture.sh VIGIL RULES EVENTS PORT OUT
# PORT is a scratch redis-server of yours: it is flushed.
set -euo pipefail
vigil=$1 rules=$2 events=$3 port=$4 out=$5
redis-cli -p "$port" flushall > /dev/null
redis-cli -p "$port" monitor > "$out" &
monitor=$!
trap 'kill "$monitor" 2> /dev/null || true' EXIT
sleep 0.3
"$vigil" replay --rules "$rules" --input "$events" --redis "redis://127.0.0.1:$port/" > /dev/null
sleep 1
echo "$(grep -c '"EVALSHA"' "$out") script calls recorded in $out"
