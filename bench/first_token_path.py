"""Where a stream's first token waits, at 512 streams: one `bench/ab.py
--rows streams512` round (Rialto, or with --proxy-server a pass-through),
traced with `perf` while it runs.

    python3 bench/first_token_path.py --bin DIR [--proxy-server actix] [--epoll]

Without --epoll, every process's socket system calls are recorded for a
second (`perf record -a`, the syscall tracepoints), the sockets are matched
across processes by their ports (`ss -tnp`), and each stream's first token
is cut into legs, p50 / p90 / mean in µs:

- the load generator's request written -> read by the server;
- the server's request read -> its request to the upstream written;
- that request written -> read by the upstream -> answered -> the answer
  read by the server;
- the server's first write to the client -> read by the load generator.

For the legs where the server picks up what waits in its socket, it also
says what the picking thread did meanwhile: how many system calls it made
(work ahead of it in its queue) and the longest pause between them (the
thread not running). Tracing every socket call slows each one, so the
legs read longer than unprofiled; compare the server against the
pass-through in the same conditions.

With --waits nothing is traced: each process's threads' own accounting
(`/proc/PID/task/TID/schedstat`), read 2 s apart, says per stream how long
they ran, how long they waited runnable for a core, and in how many
timeslices, for the server, the load generator and the upstream alike.

With --epoll only the server's `epoll_wait` calls are recorded (a few
thousand a second: the round runs nearly as unprofiled): per worker, how
often it waited, how many events each call returned, and how long it ran
between two calls, which is how long what arrives meanwhile waits to be
seen."""
import argparse
import bisect
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOCKET_CALLS = ["recvfrom", "sendto", "writev", "read", "write"]
READS, WRITES = {"recvfrom", "read"}, {"sendto", "writev", "write"}
CALL = re.compile(r"^\s*(\S.*?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+syscalls:sys_(enter|exit)_(\w+):\s*(.*)$")


def start_round(args, out):
    argv = [sys.executable, os.path.join(HERE, "ab.py"), "--bin", args.bin, "--rows", "streams512"]
    if args.proxy_server:
        argv += ["--proxy", "--proxy-server", args.proxy_server]
    round_ = subprocess.Popen(argv, stdout=open(f"{out}/ab.json", "w"), stderr=subprocess.DEVNULL)
    for _ in range(600):
        if subprocess.run(["pgrep", "-x", "bench-load"], capture_output=True).returncode == 0:
            break
        time.sleep(0.1)
    time.sleep(2.5)
    return round_


def server_pid(args):
    """Rialto, or the newest bench-proxy (the streaming upstream's)."""
    name = "bench-proxy" if args.proxy_server else "rialto"
    return int(subprocess.run(["pgrep", "-n", "-x", name], capture_output=True, text=True).stdout.split()[0])


def quantiles(xs):
    xs = sorted(xs)
    if not xs:
        return "n=0"
    return (f"n={len(xs)} p50={xs[len(xs) // 2] * 1e6:.0f} p90={xs[int(len(xs) * 0.9)] * 1e6:.0f} "
            f"mean={statistics.mean(xs) * 1e6:.0f}")


def sockets(path):
    """(pid, fd) -> (process, local address, peer address)."""
    found = {}
    for line in open(path):
        parts = line.split()
        if len(parts) < 5:
            continue
        for proc, pid, fd in re.findall(r'\("([^"]+)",pid=(\d+),fd=(\d+)\)', line):
            found[(int(pid), int(fd))] = (proc, parts[2], parts[3])
    return found


def calls_of(path, pids):
    """Each socket call as (entered, returned, pid, tid, name, fd, result)."""
    entered, calls = {}, []
    for line in open(path):
        m = CALL.match(line)
        if not m:
            continue
        _, pid, tid, _, t, kind, name, rest = m.groups()
        pid, tid, t = int(pid), int(tid), float(t)
        if pid not in pids:
            continue
        if kind == "enter":
            fd = re.search(r"fd: (0x[0-9a-f]+)", rest)
            entered[tid] = (t, name, int(fd.group(1), 16) if fd else -1)
            continue
        start = entered.pop(tid, None)
        result = re.search(r"(0x[0-9a-f]+)\s*$", rest)
        if not start or start[1] != name or not result:
            continue
        value = int(result.group(1), 16)
        calls.append((start[0], t, pid, tid, name, start[2], value - (1 << 64) if value >= 1 << 63 else value))
    calls.sort()
    return calls


def trace(args, out):
    round_ = start_round(args, out)
    subprocess.run(["ss", "-tnpH", "state", "established"], stdout=open(f"{out}/ss.txt", "w"), check=True)
    events = [f"-e syscalls:sys_{kind}_{name}" for name in SOCKET_CALLS for kind in ("enter", "exit")]
    subprocess.run(f"perf record -a -o {out}/perf.data {' '.join(events)} -- sleep {args.seconds}",
                   shell=True, capture_output=True, check=True)
    round_.wait()
    with open(f"{out}/script.txt", "w") as script:
        subprocess.run(["perf", "script", "-i", f"{out}/perf.data", "-F", "comm,pid,tid,cpu,time,event,trace"],
                       stdout=script, stderr=subprocess.DEVNULL, check=True)
    print("round:", open(f"{out}/ab.json").read().strip())

    socks = sockets(f"{out}/ss.txt")
    load = next(pid for (pid, _), (proc, _, _) in socks.items() if proc == "bench-load")
    port = next(peer for (pid, _), (_, _, peer) in socks.items() if pid == load).rsplit(":", 1)[1]
    server = next(pid for (pid, _), (_, local, _) in socks.items() if pid != load and local.endswith(":" + port))
    by_address = {(local, peer): key for key, (_, local, peer) in socks.items()}
    peer_of = {key: by_address.get((peer, local)) for key, (_, local, peer) in socks.items()}
    upstream_fds = {fd for (pid, fd), (_, local, _) in socks.items() if pid == server and not local.endswith(":" + port)}
    upstreams = {peer_of[(server, fd)][0] for fd in upstream_fds if peer_of.get((server, fd))}
    calls = calls_of(f"{out}/script.txt", {load, server, *upstreams})
    moved = collections.defaultdict(list)
    for call in calls:
        if call[6] > 0:
            moved[(call[2], call[5])].append(call)
    by_thread = collections.defaultdict(list)
    for call in calls:
        if call[2] == server:
            by_thread[call[3]].append(call)

    starts_by_thread = {tid: [c[0] for c in thread] for tid, thread in by_thread.items()}

    def first(events, names, after):
        return next((e for e in events if e[4] in names and e[1 if names is READS else 0] >= after), None)

    def meanwhile(picks):
        """What the picking thread did between the data's arrival and its read."""
        made, paused = [], []
        for since, read, tid in picks:
            starts = starts_by_thread[tid]
            inside = starts[bisect.bisect_left(starts, since):bisect.bisect_left(starts, read)]
            made.append(len(inside))
            points = [since, *inside, read]
            paused.append(max(b - a for a, b in zip(points, points[1:])))
        if made:
            made.sort()
            print(f"    meanwhile the thread made {made[len(made) // 2]} calls (median); "
                  f"its longest pause {sum(paused) / sum(r - s for s, r, _ in picks):.0%} of the wait")

    legs = collections.defaultdict(list)
    picks = []
    for (pid, fd), events in moved.items():
        if pid != load or (pid, fd) not in peer_of:
            continue
        served = moved.get(peer_of[(pid, fd)], [])
        for write in (e for e in events if e[4] in WRITES):
            read = first(served, READS, write[0])
            answered = read and first(served, WRITES, read[1])
            got = answered and first(events, READS, answered[0])
            if got:
                legs["request written -> read by the server"].append(read[1] - write[0])
                legs["server: request read -> first write to the client"].append(answered[0] - read[1])
                legs["first write -> read by the load generator"].append(got[1] - answered[0])
                legs["request written -> first data read (the first token)"].append(got[1] - write[0])
                picks.append((write[0], read[0], read[3]))
    answers = []
    for fd in upstream_fds:
        events = moved.get((server, fd), [])
        theirs = moved.get(peer_of.get((server, fd)), [])
        for i, write in enumerate(events):
            if write[4] not in WRITES:
                continue
            read = next((e for e in events[i + 1:] if e[4] in READS), None)
            taken = read and first(theirs, READS, write[0])
            sent = taken and first(theirs, WRITES, taken[1])
            if sent and sent[0] <= read[1]:
                legs["upstream: request written -> read by the upstream"].append(taken[1] - write[0])
                legs["upstream: read -> answered"].append(sent[0] - taken[1])
                legs["upstream: answered -> read by the server"].append(read[1] - sent[0])
                answers.append((sent[0], read[0], read[3]))
    for name, values in legs.items():
        print(f"{name:58} {quantiles(values)}")
        if name.startswith("request written -> read"):
            meanwhile(picks)
        if name.startswith("upstream: answered"):
            meanwhile(answers)


def epoll(args, out):
    round_ = start_round(args, out)
    pid = server_pid(args)
    subprocess.run(f"perf record -o {out}/epoll.data -e syscalls:sys_enter_epoll_wait "
                   f"-e syscalls:sys_exit_epoll_wait -p {pid} -- sleep {args.seconds}",
                   shell=True, capture_output=True, check=True)
    round_.wait()
    script = subprocess.run(["perf", "script", "-i", f"{out}/epoll.data", "-F", "tid,time,event,trace"],
                            capture_output=True, text=True).stdout
    print("round:", open(f"{out}/ab.json").read().strip())
    entered, returned, rows = {}, {}, collections.defaultdict(list)
    for line in script.splitlines():
        m = re.match(r"\s*(\d+)\s+([\d.]+):\s+syscalls:sys_(enter|exit)_epoll_wait:\s*(.*)", line)
        if not m:
            continue
        tid, t, kind, rest = int(m.group(1)), float(m.group(2)), m.group(3), m.group(4)
        if kind == "enter":
            timeout = re.search(r"timeout: (0x[0-9a-f]+)", rest)
            entered[tid] = (t, int(timeout.group(1), 16) if timeout else None)
        elif tid in entered:
            since, timeout = entered.pop(tid)
            value = int(rest.split()[-1], 16)
            ran = since - returned[tid] if tid in returned else None
            rows[tid].append((timeout, value - (1 << 64) if value >= 1 << 63 else value, ran))
            returned[tid] = t
    for tid, calls in sorted(rows.items(), key=lambda kv: -len(kv[1]))[:args.threads]:
        events = sorted(r[1] for r in calls)
        # The size of the batch an event came in, over events.
        batches = sorted(n for n in events for _ in range(max(n, 0)))
        ran = sorted(r[2] for r in calls if r[2] is not None)
        def q(xs, p):
            return xs[int(len(xs) * p)] if xs else 0
        print(f"thread {tid}: {len(calls) / args.seconds:.0f} calls/s ({sum(1 for r in calls if r[0] != 0) / args.seconds:.0f} "
              f"that could wait); an event's batch p50 {q(batches, 0.5)} p90 {q(batches, 0.9)}; "
              f"out of epoll_wait between calls (running, or runnable and waiting for a core) "
              f"p50 {q(ran, 0.5) * 1e6:.0f} p90 {q(ran, 0.9) * 1e6:.0f} µs, {sum(ran) / args.seconds:.0%} of the time")


def waits(args, out):
    round_ = start_round(args, out)
    pids = {name: server_pid(args) if name == "server" else
            int(subprocess.run(["pgrep", "-n", "-x", name], capture_output=True, text=True).stdout.split()[0])
            for name in ("server", "bench-load", "bench-upstream")}

    def snapshot():
        seen = {}
        for name, pid in pids.items():
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    thread = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
                    ran, waited, slices = map(int, open(f"/proc/{pid}/task/{tid}/schedstat").read().split())
                except OSError:
                    continue
                seen[tid] = (name, thread, ran, waited, slices)
        return seen

    before = snapshot()
    time.sleep(args.seconds)
    after = snapshot()
    round_.wait()
    row = open(f"{out}/ab.json").read().strip()
    print("round:", row)
    streams = json.loads(row)["streams512"]["streams"] / 5.0 * args.seconds
    totals = collections.defaultdict(lambda: [0, 0, 0])
    for tid, (name, thread, ran, waited, slices) in after.items():
        if tid in before:
            # Threads of one kind together: a pool's name with its number cut.
            kind = re.sub(r"[-:#]?\d+$", "", thread)
            total = totals[(name, kind)]
            total[0] += ran - before[tid][2]
            total[1] += waited - before[tid][3]
            total[2] += slices - before[tid][4]
    for (name, kind), (ran, waited, slices) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        if ran > 0:
            print(f"{name:15} {kind:18} ran {ran / 1e3 / streams:6.1f} µs a stream, waited for a core "
                  f"{waited / 1e3 / streams:6.1f} µs, in {slices / streams:.2f} timeslices")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", required=True, help="a build folder: rialto and the bench binaries")
    p.add_argument("--proxy-server", help="trace bench-proxy on this stack (hyper, actix) instead of Rialto")
    p.add_argument("--epoll", action="store_true", help="only the server's epoll_wait calls")
    p.add_argument("--waits", action="store_true", help="no tracing: each thread's time run and waited (schedstat)")
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2, help="--epoll: how many of the busiest threads to show")
    p.add_argument("--out", default="/tmp/first-token-path")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    (waits if args.waits else epoll if args.epoll else trace)(args, args.out)


if __name__ == "__main__":
    main()
