#!/usr/bin/env bash
# Runs Rialto's split topology on one machine, for manual testing: the mock
# upstream (when built), one process per service (auth, limiter, billing,
# router) each serving gRPC on its own port, and a gateway reaching them over
# gRPC. Ctrl-C (or any process exiting) stops them all.
#
#   deploy/split-local.sh
#   curl -s -X POST 127.0.0.1:8080/admin/v1/accounts \
#     -H 'Authorization: Bearer change-me' -H 'Content-Type: application/json' -d '{"name":"x"}'
#
# Overrides (deliberately not RIALTO_*: the binary refuses unknown RIALTO_*
# variables):
#   BIN=target/debug/rialto              the rialto binary
#   MOCK=target/debug/mock-upstream      the mock upstream; skipped if missing
#   CONFIG=deploy/rialto.example.toml    shared configuration
#   GATEWAY_LISTEN=127.0.0.1:8080        the gateway's HTTP address
#   DB_URL=sqlite://data/split-local.db  the database of auth and the limiter
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

BIN=${BIN:-target/debug/rialto}
MOCK=${MOCK:-target/debug/mock-upstream}
CONFIG=${CONFIG:-deploy/rialto.example.toml}
GATEWAY_LISTEN=${GATEWAY_LISTEN:-127.0.0.1:8080}
DB_URL=${DB_URL:-sqlite://data/split-local.db}
MOCK_LISTEN=127.0.0.1:18999 # the backend URL in the example config

declare -A GRPC=(
    [auth]=127.0.0.1:9091
    [limiter]=127.0.0.1:9092
    [billing]=127.0.0.1:9093
    [router]=127.0.0.1:9094
)

[[ -x $BIN ]] || { echo "split-local: $BIN not found (cargo build -p rialto, or set BIN)" >&2; exit 1; }
[[ -f $CONFIG ]] || { echo "split-local: $CONFIG not found" >&2; exit 1; }

pids=()
# shellcheck disable=SC2317,SC2329 # invoked by the traps
cleanup() {
    trap - EXIT INT TERM
    if ((${#pids[@]})); then
        kill "${pids[@]}" 2>/dev/null || true
        wait "${pids[@]}" 2>/dev/null || true
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

port_open() { (exec 3<>"/dev/tcp/${1%:*}/${1##*:}") 2>/dev/null; }

wait_for() { # ADDR NAME
    for _ in $(seq 100); do
        port_open "$1" && return 0
        sleep 0.1
    done
    echo "split-local: $2 did not listen on $1" >&2
    exit 1
}

# start NAME CMD...: runs CMD in the background, its output prefixed by NAME.
start() {
    local name=$1
    shift
    "$@" > >(sed -u "s/^/[$name] /") 2>&1 &
    pids+=($!)
}

for addr in "$GATEWAY_LISTEN" "${GRPC[@]}"; do
    if port_open "$addr"; then
        echo "split-local: $addr is already in use" >&2
        exit 1
    fi
done

if port_open "$MOCK_LISTEN"; then
    echo "split-local: something already listens on $MOCK_LISTEN; using it as the upstream"
elif [[ -x $MOCK ]]; then
    start mock "$MOCK" --listen "$MOCK_LISTEN"
    wait_for "$MOCK_LISTEN" mock-upstream
else
    echo "split-local: $MOCK not found; chat calls will fail until an upstream listens on $MOCK_LISTEN"
fi

export RIALTO_CONFIG=$CONFIG
# Every service gets the database URL; auth (accounts, keys) and the limiter
# (rate-limit log) open it. Auth starts alone first: it listens only once its
# migrations are applied, and SQLite does not lock migrations between
# processes, so auth and the limiter migrating a new file at once could fail.
start_service() { # NAME
    start "$1" env RIALTO_GRPC__LISTEN="${GRPC[$1]}" RIALTO_DATABASE__URL="$DB_URL" \
        "$BIN" serve --services "$1"
}
start_service auth
wait_for "${GRPC[auth]}" auth
for service in limiter billing router; do
    start_service "$service"
done
for service in limiter billing router; do
    wait_for "${GRPC[$service]}" "$service"
done

start gateway env RIALTO_GATEWAY__LISTEN="$GATEWAY_LISTEN" \
    RIALTO_REMOTE__AUTH="http://${GRPC[auth]}" \
    RIALTO_REMOTE__LIMITER="http://${GRPC[limiter]}" \
    RIALTO_REMOTE__BILLING="http://${GRPC[billing]}" \
    RIALTO_REMOTE__ROUTER="http://${GRPC[router]}" \
    "$BIN" serve --services gateway
wait_for "$GATEWAY_LISTEN" gateway

echo "split-local: ready on http://$GATEWAY_LISTEN (Ctrl-C stops everything)"
# Stop everything as soon as any process exits.
set +e
wait -n "${pids[@]}"
status=$?
echo "split-local: a process exited ($status); stopping the others" >&2
exit "$status"
