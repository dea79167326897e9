#!/usr/bin/env bash
# A local Rialto cluster on loopback, for development and the cluster tests:
# 2 gateways, 2 limiter replicas, 2 billing replicas, 1 auth and 1 router, each
# its own process of the rialto binary, against the local PostgreSQL and NATS
# (`make services` starts them). The processes outlive this script; their
# pids, logs and the shared configuration are under $CLUSTER_DIR.
#
#   deploy/cluster.sh up            start everything (make cluster)
#   deploy/cluster.sh down          stop everything (make cluster-down)
#   deploy/cluster.sh status        each process: running or not, its address
#   deploy/cluster.sh kill NAME     SIGKILL one process, as a crash would
#   deploy/cluster.sh pause NAME    SIGSTOP one process: hung, not dead (a
#                                   frozen VM, a stalled node)
#   deploy/cluster.sh resume NAME   SIGCONT a paused process
#   deploy/cluster.sh start NAME    start one process again, on its address
#   deploy/cluster.sh env           the cluster's addresses as shell variables
#   deploy/cluster.sh clean         down, then drop its database and delete its
#                                   JetStream streams (make test-cluster ends so)
#
# NAME is one of: gateway-0 gateway-1 auth limiter-0 limiter-1 billing-0
# billing-1 router. Addresses are fixed, so a restarted process is where its
# peers expect it:
#
#   gateway-0  http://127.0.0.1:28080   metrics 127.0.0.1:29460
#   gateway-1  http://127.0.0.1:28081   metrics 127.0.0.1:29461
#   auth       127.0.0.1:29090 (gRPC)   metrics 127.0.0.1:29462
#   limiter-0  127.0.0.1:29091          metrics 127.0.0.1:29463
#   limiter-1  127.0.0.1:29092          metrics 127.0.0.1:29464
#   billing-0  127.0.0.1:29093          metrics 127.0.0.1:29465
#   billing-1  127.0.0.1:29094          metrics 127.0.0.1:29466
#   router     127.0.0.1:29095          metrics 127.0.0.1:29467
#
# Settings (environment; deliberately not RIALTO_*):
#   CLUSTER_BIN=target/debug/rialto      the binary (make cluster builds it)
#   CLUSTER_DIR=data/cluster             config, pids, logs (logs/NAME.log)
#   CLUSTER_POSTGRES=postgres://postgres@127.0.0.1:5432
#   CLUSTER_DATABASE=rialto_cluster      created when missing, kept by `down`,
#                                        dropped by `clean`
#   CLUSTER_NATS=nats://127.0.0.1:4222
#   CLUSTER_BUS_PREFIX=rialto-cluster    NATS subjects and JetStream streams (those
#                                        under it are deleted by `clean`)
#   CLUSTER_PORT_OFFSET=0                added to every port above (100 for a second
#                                        cluster beside the first: another
#                                        CLUSTER_DIR, DATABASE, BUS_PREFIX too)
#   CLUSTER_EXTRA_TOML=FILE              appended to the configuration at `up`
#                                        (e.g. [[models]] on a mock upstream;
#                                        without it, the built-in models)
#
# The operator token is `cluster-operator-token`, the gRPC token
# `cluster-grpc-token`: a cluster for this machine only.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

DIR=${CLUSTER_DIR:-data/cluster}
# `start NAME` runs the binary `up` ran (recorded in pids/binary), wherever
# CARGO_TARGET_DIR put it, unless CLUSTER_BIN says otherwise.
if [[ -n ${CLUSTER_BIN:-} ]]; then
    BIN=$CLUSTER_BIN
elif [[ ${1:-} == start && -f $DIR/pids/binary ]]; then
    BIN=$(cat "$DIR/pids/binary")
else
    BIN=target/debug/rialto
fi
POSTGRES=${CLUSTER_POSTGRES:-postgres://postgres@127.0.0.1:5432}
DATABASE=${CLUSTER_DATABASE:-rialto_cluster}
NATS=${CLUSTER_NATS:-nats://127.0.0.1:4222}
BUS_PREFIX=${CLUSTER_BUS_PREFIX:-rialto-cluster}
EXTRA_TOML=${CLUSTER_EXTRA_TOML:-}
OPERATOR_TOKEN=cluster-operator-token
GRPC_TOKEN=cluster-grpc-token

NAMES=(auth limiter-0 limiter-1 billing-0 billing-1 router gateway-0 gateway-1)
OFFSET=${CLUSTER_PORT_OFFSET:-0}
[[ $OFFSET =~ ^[0-9]+$ ]] || { echo "cluster: CLUSTER_PORT_OFFSET must be a number" >&2; exit 2; }
declare -A LISTEN METRICS
for i in "${!NAMES[@]}"; do
    # NAMES order: auth limiter-0 limiter-1 billing-0 billing-1 router gateway-0 gateway-1
    name=${NAMES[$i]}
    case $name in
    gateway-*) LISTEN[$name]=127.0.0.1:$((28080 + ${name#gateway-} + OFFSET)) ;;
    *) LISTEN[$name]=127.0.0.1:$((29090 + i + OFFSET)) ;;
    esac
done
i=0
for name in gateway-0 gateway-1 auth limiter-0 limiter-1 billing-0 billing-1 router; do
    METRICS[$name]=127.0.0.1:$((29460 + i + OFFSET))
    i=$((i + 1))
done
unset i name
CONFIG=$DIR/rialto.toml
STARTUP_SECS=120

say() { echo "cluster: $*"; }
die() { echo "cluster: $*" >&2; exit 1; }

service_of() { echo "${1%-[0-9]}"; } # limiter-1 -> limiter
port_open() { (exec 3<>"/dev/tcp/${1%:*}/${1##*:}") 2>/dev/null; }
pid_file() { echo "$DIR/pids/$1.pid"; }

# The pid of NAME if it is alive and still the binary `up` started (a pid
# the system gave to something else since is not ours to signal), else
# nothing.
running_pid() {
    local file pid binary
    file=$(pid_file "$1")
    [[ -f $file && -f $DIR/pids/binary ]] || return 0
    pid=$(<"$file")
    binary=$(<"$DIR/pids/binary")
    # (A binary rebuilt since shows as "PATH (deleted)": still ours.)
    if [[ -n $pid ]] && [[ $(readlink "/proc/$pid/exe" 2>/dev/null) =~ ^"$binary"( \(deleted\))?$ ]] \
        && ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null; then
        echo "$pid"
    fi
}

check_name() {
    [[ -n ${LISTEN[$1]:-} ]] || die "unknown process $1 (one of: ${NAMES[*]})"
}

write_config() {
    local url=${POSTGRES%/}/$DATABASE
    cat >"$CONFIG" <<EOF
# Written by deploy/cluster.sh up: the configuration of every process of the
# local cluster. Listen addresses come from each process's environment.
brand = "rialto"

[grpc]
token = "$GRPC_TOKEN"

[operator]
token = "$OPERATOR_TOKEN"

[database]
url = "$url"
max_connections = 8

[remote]
auth = "http://${LISTEN[auth]}"
limiter = "http://${LISTEN[limiter-0]},http://${LISTEN[limiter-1]}"
billing = "http://${LISTEN[billing-0]},http://${LISTEN[billing-1]}"
router = "http://${LISTEN[router]}"

[bus]
url = "$NATS"
subject_prefix = "$BUS_PREFIX"

[log]
format = "text"
level = "info"
EOF
    if [[ -n $EXTRA_TOML ]]; then
        [[ -f $EXTRA_TOML ]] || die "CLUSTER_EXTRA_TOML=$EXTRA_TOML not found"
        { echo; echo "# From $EXTRA_TOML:"; cat "$EXTRA_TOML"; } >>"$CONFIG"
    fi
}

write_env() {
    cat >"$DIR/cluster.env" <<EOF
CLUSTER_GATEWAYS=http://${LISTEN[gateway-0]},http://${LISTEN[gateway-1]}
CLUSTER_OPERATOR_TOKEN=$OPERATOR_TOKEN
CLUSTER_GRPC_TOKEN=$GRPC_TOKEN
CLUSTER_DATABASE_URL=${POSTGRES%/}/$DATABASE
CLUSTER_NATS=$NATS
CLUSTER_BUS_PREFIX=$BUS_PREFIX
CLUSTER_CONFIG=$CONFIG
CLUSTER_LOGS=$DIR/logs
EOF
    local name key
    for name in "${NAMES[@]}"; do
        key=${name^^}
        key=${key//-/_}
        echo "CLUSTER_${key}=${LISTEN[$name]}"
        echo "CLUSTER_${key}_METRICS=${METRICS[$name]}"
    done >>"$DIR/cluster.env"
}

ensure_database() {
    command -v psql >/dev/null || die "psql not found (make services installs PostgreSQL)"
    local exists
    exists=$(psql "${POSTGRES%/}/postgres" -tAc "SELECT 1 FROM pg_database WHERE datname = '$DATABASE'") \
        || die "cannot reach PostgreSQL at $POSTGRES (make services starts it)"
    if [[ $exists != 1 ]]; then
        psql "${POSTGRES%/}/postgres" -qc "CREATE DATABASE \"$DATABASE\"" >/dev/null
        say "created database $DATABASE"
    fi
}

# start NAME: launches the process in a session of its own (so that it
# outlives this script and a Ctrl-C of make), logging to logs/NAME.log.
start_one() {
    local name=$1 service envs
    service=$(service_of "$name")
    [[ -z $(running_pid "$name") ]] || die "$name is already running (pid $(running_pid "$name"))"
    port_open "${LISTEN[$name]}" && die "$name: ${LISTEN[$name]} is in use by another process"
    envs=(RIALTO_CONFIG="$CONFIG" RIALTO_METRICS__LISTEN="${METRICS[$name]}" NO_COLOR=1)
    if [[ $service == gateway ]]; then
        envs+=(RIALTO_GATEWAY__LISTEN="${LISTEN[$name]}")
    else
        envs+=(RIALTO_GRPC__LISTEN="${LISTEN[$name]}")
    fi
    echo "=== $(date -u +%FT%TZ) start $name" >>"$DIR/logs/$name.log"
    env "${envs[@]}" setsid "$BIN" serve --services "$service" \
        </dev/null >>"$DIR/logs/$name.log" 2>&1 &
    local pid=$! _
    echo "$pid" >"$(pid_file "$name")"
    # env and setsid exec the binary in turn: wait until the pid is it.
    for _ in $(seq 50); do
        [[ -n $(running_pid "$name") ]] && return 0
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.02
    done
}

# wait_up NAME...: until each listens, or fails with its log when one exits.
wait_up() {
    local deadline=$((SECONDS + STARTUP_SECS)) name pending
    while :; do
        pending=()
        for name in "$@"; do
            port_open "${LISTEN[$name]}" && continue
            if [[ -z $(running_pid "$name") ]]; then
                echo "cluster: $name exited; the end of $DIR/logs/$name.log:" >&2
                tail -n 30 "$DIR/logs/$name.log" >&2
                return 1
            fi
            pending+=("$name")
        done
        ((${#pending[@]})) || return 0
        ((SECONDS < deadline)) || { echo "cluster: not listening after ${STARTUP_SECS}s: ${pending[*]}" >&2; return 1; }
        sleep 0.2
    done
}

wait_ready() { # gateway NAME: /readyz answers 200
    local url="http://${LISTEN[$1]}/readyz" deadline=$((SECONDS + 30))
    command -v curl >/dev/null || return 0
    until curl -fsS -o /dev/null "$url"; do
        ((SECONDS < deadline)) || { echo "cluster: $url never answered 200" >&2; return 1; }
        sleep 0.2
    done
}

stop_one() { # NAME SIGNAL
    local pid
    pid=$(running_pid "$1")
    if [[ -n $pid ]]; then
        kill "-$2" "$pid" 2>/dev/null || true
    fi
}

cmd_up() {
    [[ -x $BIN ]] || die "$BIN not found: build it (cargo build -p rialto) or set CLUSTER_BIN"
    port_open "${NATS#nats://}" || die "NATS is not listening at $NATS (make services starts it)"
    mkdir -p "$DIR/pids" "$DIR/logs"
    local name
    for name in "${NAMES[@]}"; do
        [[ -z $(running_pid "$name") ]] || die "$name is running already: deploy/cluster.sh down first"
        port_open "${LISTEN[$name]}" && die "${LISTEN[$name]} ($name) is in use by another process"
    done
    rm -f "$DIR"/pids/*.pid
    readlink -f "$BIN" >"$DIR/pids/binary"
    ensure_database
    write_config
    write_env
    # auth first: it applies the migrations the others share (PostgreSQL
    # serialises concurrent migrators, but one at a time starts faster).
    start_one auth
    wait_up auth || { cmd_down; exit 1; }
    for name in limiter-0 limiter-1 billing-0 billing-1 router; do
        start_one "$name"
    done
    wait_up limiter-0 limiter-1 billing-0 billing-1 router || { cmd_down; exit 1; }
    start_one gateway-0
    start_one gateway-1
    wait_up gateway-0 gateway-1 || { cmd_down; exit 1; }
    if ! wait_ready gateway-0 || ! wait_ready gateway-1; then
        cmd_down
        exit 1
    fi
    say "up: gateways http://${LISTEN[gateway-0]} and http://${LISTEN[gateway-1]} (operator token $OPERATOR_TOKEN)"
    say "logs in $DIR/logs/, addresses in $DIR/cluster.env; stop with make cluster-down"
}

cmd_down() {
    local name pid deadline=$((SECONDS + 30)) left
    [[ -d $DIR/pids ]] || { say "not running"; return 0; }
    # Gateways first, so that nothing new reaches the services they call.
    for name in gateway-0 gateway-1; do stop_one "$name" TERM; done
    while [[ -n $(running_pid gateway-0)$(running_pid gateway-1) ]] && ((SECONDS < deadline)); do sleep 0.2; done
    for name in "${NAMES[@]}"; do stop_one "$name" TERM; done
    while :; do
        left=()
        for name in "${NAMES[@]}"; do
            pid=$(running_pid "$name")
            [[ -n $pid ]] && left+=("$name")
        done
        ((${#left[@]})) || break
        if ((SECONDS >= deadline)); then
            say "still running after 30 s, killing: ${left[*]}"
            for name in "${left[@]}"; do stop_one "$name" KILL; done
            sleep 0.5
            break
        fi
        sleep 0.2
    done
    rm -f "$DIR"/pids/*.pid "$DIR/pids/binary"
    say "down"
}

# The JetStream streams holding subjects under the prefix (the usage queue,
# `<prefix>-usage`), deleted over the NATS protocol itself: the server's API
# is request-reply on $JS.API.*, so python3's standard library suffices.
delete_streams() {
    command -v python3 >/dev/null || die "python3 not found (it deletes the JetStream streams)"
    python3 - "$NATS" "$BUS_PREFIX" <<'PYTHON'
import json, socket, sys

url, prefix = sys.argv[1], sys.argv[2]
host, port = url.removeprefix("nats://").rsplit(":", 1)
sock = socket.create_connection((host, int(port)), timeout=10)
reader = sock.makefile("rb")
reader.readline()  # INFO
sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"protocol":1}\r\nSUB _INBOX.cluster-clean 1\r\n')


def request(subject, payload):
    data = json.dumps(payload).encode() if payload is not None else b""
    sock.sendall(b"PUB %s _INBOX.cluster-clean %d\r\n%s\r\n" % (subject.encode(), len(data), data))
    while True:
        line = reader.readline()
        if not line:
            sys.exit("cluster: NATS closed the connection")
        if line.startswith(b"PING"):
            sock.sendall(b"PONG\r\n")
        elif line.startswith(b"-ERR"):
            sys.exit(f"cluster: NATS: {line.decode().strip()}")
        elif line.startswith((b"MSG ", b"HMSG ")):
            size = int(line.split()[-1])
            body = reader.read(size + 2)[:size]
            if line.startswith(b"HMSG "):  # a status (503: no JetStream here)
                sys.exit(f"cluster: JetStream did not answer {subject}: {body[:80]!r}")
            return json.loads(body)


names, offset = [], 0
while True:
    answer = request("$JS.API.STREAM.NAMES", {"subject": f"{prefix}.>", "offset": offset})
    if "error" in answer:
        sys.exit(f"cluster: listing JetStream streams: {answer['error']}")
    found = answer.get("streams") or []
    names += found
    offset += len(found)
    if not found or offset >= answer.get("total", 0):
        break
for name in names:
    answer = request(f"$JS.API.STREAM.DELETE.{name}", None)
    if not answer.get("success"):
        sys.exit(f"cluster: deleting stream {name}: {answer.get('error')}")
    print(f"cluster: deleted JetStream stream {name}")
PYTHON
}

cmd_clean() {
    cmd_down
    if port_open "${NATS#nats://}"; then
        delete_streams
    else
        say "NATS is not listening at $NATS: no streams deleted"
    fi
    command -v psql >/dev/null || die "psql not found (make services installs PostgreSQL)"
    psql "${POSTGRES%/}/postgres" -qc "SET client_min_messages = warning" \
        -c "DROP DATABASE IF EXISTS \"$DATABASE\" WITH (FORCE)" >/dev/null \
        || die "cannot drop database $DATABASE at $POSTGRES"
    rm -f "$CONFIG" "$DIR/cluster.env"
    say "clean: database $DATABASE dropped, streams under $BUS_PREFIX deleted (logs kept in $DIR/logs)"
}

cmd_status() {
    local name pid state
    for name in "${NAMES[@]}"; do
        pid=$(running_pid "$name")
        if [[ -n $pid ]]; then state="running (pid $pid)"; else state=stopped; fi
        printf '%-10s %-16s %s\n' "$name" "${LISTEN[$name]}" "$state"
    done
}

case ${1:-} in
up) cmd_up ;;
down) cmd_down ;;
clean) cmd_clean ;;
status) cmd_status ;;
env)
    [[ -f $DIR/cluster.env ]] || die "no cluster here (deploy/cluster.sh up)"
    cat "$DIR/cluster.env"
    ;;
kill)
    check_name "${2:-}"
    [[ -n $(running_pid "$2") ]] || die "$2 is not running"
    stop_one "$2" KILL
    while [[ -n $(running_pid "$2") ]]; do sleep 0.05; done
    say "killed $2"
    ;;
pause | resume)
    check_name "${2:-}"
    pid=$(running_pid "$2")
    [[ -n $pid ]] || die "$2 is not running"
    if [[ $1 == pause ]]; then kill -STOP "$pid"; else kill -CONT "$pid"; fi
    say "${1}d $2"
    ;;
start)
    check_name "${2:-}"
    [[ -f $DIR/pids/binary ]] || die "the cluster is not up (deploy/cluster.sh up)"
    start_one "$2"
    wait_up "$2"
    if [[ $(service_of "$2") == gateway ]]; then wait_ready "$2"; fi
    say "started $2 on ${LISTEN[$2]}"
    ;;
*)
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
    exit 2
    ;;
esac
