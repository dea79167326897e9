"""Where a stream's first token waits, at 512 streams: one `bench/ab.py
--rows streams512` round (Rialto, or with --proxy-server a pass-through),
traced with `perf` while it runs.

    python3 bench/first_token_path.py --bin DIR [--proxy-server actix] [--epoll]

Without --epoll, every process's socket system calls are recorded for a
second (`perf record -a`, the syscall tracepoints), the sockets are matched
across processes by their ports (`ss -tnp`), and each stream's first token
is cut into legs, p50 / p90 / mean in µs:

- the load generator's request written -> read by the server;
- the server's request read -> its request to the upstream written (on the
  same thread: the handler);
- the server's request read -> its first write to the client, and that
  write -> read by the load generator. Rialto's first write carries the
  head and the first chunk together, by design; the actix pass-through's
  does in most streams, the head alone in the rest (about one in ten);
- over every request the server sends the upstream: written -> read by
  the upstream -> the upstream's first write (its head: bench-upstream
  writes the head, then the first chunk) -> the server's next read.

For the two legs where the server picks up what waits in its socket, it
also says what the picking thread did meanwhile: how many socket calls it
made (the work ahead of the pick-up in its queue), and the longest gap
between two of them as a share of the wait (summed over the waits; a gap
is time the thread did not run, or ran without a socket call). Tracing
every socket call slows each one, so the legs read longer than
unprofiled; compare the server against the pass-through in the same
conditions.

With --waits nothing is traced: each process's threads' own accounting
(`/proc/PID/task/TID/schedstat`), read --seconds apart, says per stream how long
they ran, how long they waited runnable for a core, and in how many
timeslices, for the server, the load generator and the upstream alike.

With --epoll only the server's `epoll_wait` calls are recorded (a few
thousand a second: the round runs nearly as unprofiled). For the busiest
threads (the HTTP workers: actix runs each on a current-thread runtime that
waits in `epoll_wait`), how often each called it, how many events each call
returned, and how long it stayed out of it between two calls (running, or
runnable and waiting for a core), which is how long what arrives meanwhile
waits to be seen.

Every process is looked up among the round's own (descendants of its
`ab.py`), so another run on the machine is not mistaken for it."""
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
    """Starts the round; returns once its load has run for 2.5 s."""
    argv = [sys.executable, os.path.join(HERE, "ab.py"), "--bin", args.bin, "--rows", "streams512",
            "--duration", str(round_seconds(args))]
    if args.proxy_server:
        argv += ["--proxy", "--proxy-server", args.proxy_server]
    round_ = subprocess.Popen(argv, stdout=open(f"{out}/ab.json", "w"), stderr=open(f"{out}/ab.err", "w"))
    for _ in range(1200):
        if round_.poll() is not None:
            sys.exit(f"ab.py ended before its load began:\n{open(f'{out}/ab.err').read()[-2000:]}")
        if process(round_, "bench-load"):
            break
        time.sleep(0.1)
    else:
        sys.exit("no bench-load after 120 s")
    time.sleep(2.5)
    return round_


def round_seconds(args):
    """The round's measured load: what is traced, and a margin either side."""
    return max(5.0, args.seconds + 4.0)


def process(round_, name):
    """The newest process called `name` that the round started, or None."""
    children = collections.defaultdict(list)
    started = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            # The name is in parentheses and may hold spaces.
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            children[int(fields[1])].append(int(entry))
            started[int(entry)] = (int(fields[19]), comm)
    found, queue = [], [round_.pid]
    while queue:
        for pid in children.get(queue.pop(), []):
            queue.append(pid)
            if started[pid][1] == name:
                found.append(pid)
    return max(found, key=lambda pid: started[pid][0], default=None)


def server_pid(args, round_):
    """Rialto, or the newest bench-proxy (the streaming upstream's)."""
    pid = process(round_, "bench-proxy" if args.proxy_server else "rialto")
    if pid is None:
        sys.exit("the round's server is gone")
    return pid


def round_row(out):
    """The round's streams512 row, as ab.py printed it."""
    try:
        return json.loads(open(f"{out}/ab.json").read())["streams512"]
    except (ValueError, KeyError):
        sys.exit(f"ab.py printed no row:\n{open(f'{out}/ab.err').read()[-2000:]}")


def quantiles(xs):
    xs = sorted(xs)
    if not xs:
        return "n=0"
    return (f"n={len(xs)} p50={xs[len(xs) // 2] * 1e6:.0f} p90={xs[int(len(xs) * 0.9)] * 1e6:.0f} "
            f"mean={statistics.mean(xs) * 1e6:.0f}")


def sockets(path):
    """(pid, fd) -> (local address, peer address)."""
    found = {}
    for line in open(path):
        parts = line.split()
        if len(parts) < 5:
            continue
        for pid, fd in re.findall(r'\("[^"]+",pid=(\d+),fd=(\d+)\)', line):
            found[(int(pid), int(fd))] = (parts[2], parts[3])
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
    load, server = process(round_, "bench-load"), server_pid(args, round_)
    subprocess.run(["ss", "-tnpH", "state", "established"], stdout=open(f"{out}/ss.txt", "w"), check=True)
    events = [f"-e syscalls:sys_{kind}_{name}" for name in SOCKET_CALLS for kind in ("enter", "exit")]
    subprocess.run(f"perf record -a -o {out}/perf.data {' '.join(events)} -- sleep {args.seconds}",
                   shell=True, capture_output=True, check=True)
    round_.wait()
    with open(f"{out}/script.txt", "w") as script:
        subprocess.run(["perf", "script", "-i", f"{out}/perf.data", "-F", "comm,pid,tid,cpu,time,event,trace"],
                       stdout=script, stderr=subprocess.DEVNULL, check=True)
    print("round:", json.dumps(round_row(out)))
    analyse(out, load, server)


def analyse(out, load, server):
    """The legs, from what `trace` recorded in `out`."""
    socks = sockets(f"{out}/ss.txt")
    port = next((peer for (pid, _), (_, peer) in socks.items() if pid == load), ":").rsplit(":", 1)[1]
    if not port:
        sys.exit("the load generator had no connection open")
    by_address = {(local, peer): key for key, (local, peer) in socks.items()}
    peer_of = {key: by_address.get((peer, local)) for key, (local, peer) in socks.items()}
    upstream_fds = {fd for (pid, fd), (local, _) in socks.items() if pid == server and not local.endswith(":" + port)}
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
        """The first call of `names` returning after `after` (a read) or entered after it (a write)."""
        ended = names == READS
        return next((e for e in events if e[4] in names and e[1 if ended else 0] >= after and e[6] > 0), None)

    def to_upstream(tid, after, before):
        """The thread's first request to an upstream between two times."""
        thread, starts = by_thread[tid], starts_by_thread[tid]
        for call in thread[bisect.bisect_left(starts, after):bisect.bisect_right(starts, before)]:
            if call[4] in WRITES and call[5] in upstream_fds and call[6] > 0:
                return call
        return None

    def meanwhile(picks):
        """What the picking thread did between the data's arrival and its read."""
        made, paused = [], []
        for since, read, tid in picks:
            starts = starts_by_thread[tid]
            inside = starts[bisect.bisect_left(starts, since):bisect.bisect_left(starts, read)]
            made.append(len(inside))
            points = [since, *inside, read]
            paused.append(max(b - a for a, b in zip(points, points[1:])))
        waited = sum(read - since for since, read, _ in picks)
        if made and waited > 0:
            made.sort()
            print(f"    meanwhile the thread made {made[len(made) // 2]} socket calls (median); "
                  f"the longest gap between two, {sum(paused) / waited:.0%} of the wait")

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
            if got and read[0] >= write[0]:
                legs["request written -> read by the server"].append(read[1] - write[0])
                handler = to_upstream(read[3], read[1], answered[0])
                if handler:
                    legs["server: request read -> upstream's request written"].append(handler[0] - read[1])
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
            if sent and sent[0] <= read[1] and read[0] >= sent[0]:
                legs["upstream: request written -> read by the upstream"].append(taken[1] - write[0])
                legs["upstream: read -> its first write (the head)"].append(sent[0] - taken[1])
                legs["upstream: its first write -> the server's next read"].append(read[1] - sent[0])
                answers.append((sent[0], read[0], read[3]))
    print("leg (µs)")
    order = ["request written -> read by the server", "server: request read -> upstream's request written",
             "server: request read -> first write to the client", "first write -> read by the load generator",
             "request written -> first data read (the first token)",
             "upstream: request written -> read by the upstream", "upstream: read -> its first write (the head)",
             "upstream: its first write -> the server's next read"]
    for name in order:
        print(f"{name:58} {quantiles(legs[name])}")
        if name == order[0]:
            meanwhile(picks)
        if name == order[-1]:
            meanwhile(answers)


def epoll(args, out):
    round_ = start_round(args, out)
    pid = server_pid(args, round_)
    names = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            names[int(tid)] = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
        except OSError:
            pass
    subprocess.run(f"perf record -o {out}/epoll.data -e syscalls:sys_enter_epoll_wait "
                   f"-e syscalls:sys_exit_epoll_wait -p {pid} -- sleep {args.seconds}",
                   shell=True, capture_output=True, check=True)
    round_.wait()
    script = subprocess.run(["perf", "script", "-i", f"{out}/epoll.data", "-F", "tid,time,event,trace"],
                            capture_output=True, text=True).stdout
    print("round:", json.dumps(round_row(out)))
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
        print(f"thread {tid} ({names.get(tid, '?')}): {len(calls) / args.seconds:.0f} calls/s ({sum(1 for r in calls if r[0] != 0) / args.seconds:.0f} "
              f"that could wait); an event's batch p50 {q(batches, 0.5)} p90 {q(batches, 0.9)}; "
              f"out of epoll_wait between calls (running, or runnable and waiting for a core) "
              f"p50 {q(ran, 0.5) * 1e6:.0f} p90 {q(ran, 0.9) * 1e6:.0f} µs, {sum(ran) / args.seconds:.0%} of the time")


def waits(args, out):
    round_ = start_round(args, out)
    pids = {"server": server_pid(args, round_), "bench-load": process(round_, "bench-load"),
            "bench-upstream": process(round_, "bench-upstream")}

    def snapshot():
        seen = {}
        for name, pid in pids.items():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                sys.exit(f"{name} ended before the second reading: try fewer --seconds")
            for tid in tids:
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
    row = round_row(out)
    print("round:", json.dumps(row))
    streams = row["streams"] / round_seconds(args) * args.seconds
    if streams <= 0:
        sys.exit("the round completed no stream")
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
    p.add_argument("--proxy-server", help="trace bench-proxy on this stack (hyper, hyper-pinned, actix) instead of Rialto")
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
