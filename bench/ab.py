"""A/B runs of single rows of `make bench` between builds, on this noisy VM:
run.py's upstreams, configuration and load generator, one build folder
(holding rialto and the bench binaries) and one environment per run, only the
rows asked for, each printed as a JSON line with the CPU its processes used
per request (per stream). Interleave runs of two builds and compare medians:

    python3 bench/ab.py --bin /tmp/before --rows streams512,max
    python3 bench/ab.py --bin target/release --split --rows open \
        --env auth:TOKIO_WORKER_THREADS=1 --env limiter:TOKIO_WORKER_THREADS=1

Rows: idle (VmRSS after start-up, with the largest mappings), c1
(concurrency 1), open (the fixed rate: 5,000 req/s, 2,000 split), max (64
connections), streamsN (N concurrent streams, their openings spread out as
in run.py), togetherN (N streams opened together), hotN (N streams back to back
from the instant upstream: a stream's first token on warm caches); each loaded
row also reports
CPU and context switches per request (--by-thread: by process and thread
name, CPU per request by thread, and switches split into voluntary (it
waited) and involuntary (preempted)). --floor and --proxy measure the
upstream alone and bench-proxy in front of it (--proxy-server actix: the same
pass-through on actix-web and reqwest, Rialto's HTTP stack); --model picks Rialto's model
for the non-streamed rows (fast, priced; fast-free; fast-unlimited, which no
window limits), --stream-model the same for the streamsN and togetherN rows
(stream, stream-free, stream-unlimited): their difference is billing's and
the limiter's share of a stream."""
import argparse
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as B  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--bin", required=True)
p.add_argument("--rows", default="c1,open,streams,max")
p.add_argument("--split", action="store_true")
p.add_argument("--floor", action="store_true")
p.add_argument("--proxy", action="store_true")
p.add_argument("--proxy-server", default="hyper", help="bench-proxy's HTTP stack: hyper (work-stealing), hyper-pinned (a single-threaded runtime per thread), or actix (actix-web and reqwest)")
p.add_argument("--env", action="append", default=[], help="SERVICE:NAME=VALUE or NAME=VALUE for all")
p.add_argument("--duration", type=float, default=5.0)
p.add_argument("--rate", type=int)
p.add_argument("--by-thread", action="store_true", help="context switches per request by process and thread name")
p.add_argument("--model", default="fast", help="the non-streamed rows' model: fast (priced), fast-free, fast-unlimited")
p.add_argument("--stream-model", default="stream",
               help="the streamsN and togetherN rows' model: stream (priced), stream-free, stream-unlimited")
a = p.parse_args()

args = types.SimpleNamespace(target_dir="/nonexistent", profile="release", smoke=False, duration=a.duration,
                             litellm_venv="")
s = B.Suite(args)
s.bin = a.bin
s.start_upstreams()

def env_for(service):
    env = {}
    for item in a.env:
        svc, _, kv = item.rpartition(":")
        if svc in ("", service):
            k, _, v = kv.partition("=")
            env[k] = v
    return env

procs = B.Processes(s.workdir)
out = {}
try:
    if a.proxy:
        urls = {}
        for name, b in s.upstreams.items():
            up = b.removeprefix("http://").removesuffix("/v1")
            addr = procs.start(f"proxy-{name}", [s.binary("bench-proxy"), "--listen", "127.0.0.1:0", "--upstream", up,
                                                 "--threads", "2", "--server", a.proxy_server], announce=r"bench-proxy listening on (\S+)")
            urls[name] = f"http://{addr}/v1"
            B.wait_http(f"{urls[name]}/models", 10)
        url = lambda m: f"{urls[m]}/chat/completions"
        headers = {}
        model = lambda m: "bench-model"
    elif a.floor:
        url = lambda m: f"{s.upstreams[m]}/chat/completions"
        headers = {}
        model = lambda m: "bench-model"
    else:
        config = os.path.join(s.workdir, "r.toml")
        operator = s.rialto_config(config)
        rialto = [s.binary("rialto"), "--config", config, "serve"]
        if a.split:
            env = {}
            for service in ("auth", "limiter", "billing", "router"):
                addr = procs.start(service, [*rialto, "--services", service], env=env_for(service),
                                   announce=r"grpc listening on (\S+)")
                env[f"RIALTO_REMOTE__{service.upper()}"] = f"http://{addr}"
            addr = procs.start("gateway", [*rialto, "--services", "gateway"], env={**env, **env_for("gateway")},
                               announce=r"gateway listening on http://(\S+)")
        else:
            addr = procs.start("gateway", rialto, env=env_for("gateway"), announce=r"gateway listening on http://(\S+)")
        base = f"http://{addr}"
        B.wait_http(f"{base}/healthz", 30)
        key = B.inference_key(base, operator)
        url = lambda m: f"{base}/api/v1/chat/completions"
        headers = {"Authorization": f"Bearer {key}"}
        model = lambda m: f"bench-{m}"
    body = lambda m, **x: {"model": model(m), "messages": B.CHAT, **x}
    rows = a.rows.split(",")
    def ticks():
        total = 0
        for pid in procs.pids(None):
            try:
                f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                total += int(f[11]) + int(f[12])
            except OSError:
                pass
        return total
    def switches():
        # Context switches of every thread (voluntary and not): each is a
        # wake-up or a preemption, the cost a VM's CPU time shows least
        # faithfully and that does not move with the host's noise. By
        # process and thread name, for --by-thread.
        counts = {}
        for name, child in procs.children:
            for pid in procs.pids([name]):
                try:
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
                        # and CPU ticks (user + system), keyed "cpu:" for --by-thread
                        f = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
                        key = f"cpu:{name}/{comm}"
                        counts[key] = counts.get(key, 0) + int(f[11]) + int(f[12])
                        for line in open(f"/proc/{pid}/task/{tid}/status"):
                            if "ctxt_switches:" in line:
                                # voluntary (it waited) or not (preempted)
                                kind = "invol" if line.startswith("nonvoluntary") else "vol"
                                key = f"{name}/{comm}/{kind}"
                                counts[key] = counts.get(key, 0) + int(line.split()[1])
                except OSError:
                    pass
        return counts
    hz = os.sysconf("SC_CLK_TCK")
    rate = a.rate or (2000 if a.split else 5000)
    for row in rows:
        t0, w0 = ticks(), switches()
        if row == "idle":
            # What the memory row reads: VmRSS after start-up and the key's
            # creation, before any load; with the largest mappings.
            time.sleep(2)
            for pid in procs.pids(None):
                status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
                mappings, name = {}, "?"
                for line in open(f"/proc/{pid}/smaps"):
                    head = line.split()
                    if "-" in head[0] and not head[0].endswith(":"):
                        name = head[5] if len(head) > 5 else "[anon]"
                    elif head[0] == "Rss:":
                        mappings[name] = mappings.get(name, 0) + int(head[1])
                top = sorted(mappings.items(), key=lambda kv: -kv[1])[:5]
                out.setdefault("idle", []).append({
                    "pid": pid, "rss_kb": int(status["VmRSS"].split()[0]),
                    "anon_kb": int(status["RssAnon"].split()[0]), "file_kb": int(status["RssFile"].split()[0]),
                    "threads": int(status["Threads"]), "largest_kb": top})
            print(json.dumps({"idle": out["idle"]}), flush=True)
            continue
        if row == "c1":
            r = s.load("closed", url(a.model), headers, body(a.model), concurrency=1)
            out["c1"] = {q: r["latency_us"][q] for q in ("p50", "p99", "p999")}
        elif row == "open":
            r = s.load("open", url(a.model), headers, body(a.model), rate=rate, connections=min(256, max(64, rate // 20)))
            out[f"open{rate}"] = {"p50": r["latency_us"]["p50"], "p99": r["latency_us"]["p99"], "rps": r["rps"], "errors": r["errors"]}
        elif row == "max":
            r = s.load("closed", url(a.model), headers, body(a.model), concurrency=64)
            out["max"] = {"rps": r["rps"], "p50": r["latency_us"]["p50"], "p99": r["latency_us"]["p99"], "errors": r["errors"]}
        elif row.startswith(("hot", "streams", "together")):
            if row.startswith("hot"):
                # Streams back to back from the instant upstream (16 chunks,
                # no delay between them): a stream's cost on warm caches.
                n, upstream, options = int(row[3:] or 1), "fast", {}
            else:
                together = row.startswith("together")
                n, upstream = int(row[8 if together else 7:] or 512), "stream"
                options = {} if together else {"spread": s.spread}
            m = upstream if row.startswith("hot") else a.stream_model
            r = s.load("stream", url(upstream), headers, body(m, stream=True), concurrency=n, **options)
            out[row] = {"first_p50": r["first_token_us"]["p50"], "first_p99": r["first_token_us"]["p99"],
                        "streams": r["streams"], "errors": r["errors"]}
        w1 = switches()
        by_thread = {k: v - w0.get(k, 0) for k, v in w1.items() if not k.startswith("cpu:")}
        cpu_by_thread = {k[4:]: v - w0.get(k, 0) for k, v in w1.items() if k.startswith("cpu:")}
        cpu_s, woken = (ticks() - t0) / hz, sum(by_thread.values())
        res = out.get(row) or out.get(f"open{rate}")
        n = res.get("streams") or (res.get("rps", 0) * a.duration) or 0
        if row == "c1":
            n = None
        if n:
            # The warm-up's requests count too (load runs it before the measured window).
            each = n * (a.duration + 1.0) / a.duration
            res["cpu_us_each"] = round(cpu_s * 1e6 / each)
            res["switches_each"] = round(woken / each, 2)
            if a.by_thread:
                res["switches_by_thread"] = {k: round(v / each, 2) for k, v in
                                             sorted(by_thread.items(), key=lambda kv: -kv[1]) if v / each >= 0.05}
                res["cpu_us_by_thread"] = {k: round(v / hz * 1e6 / each) for k, v in
                                           sorted(cpu_by_thread.items(), key=lambda kv: -kv[1]) if v / hz * 1e6 / each >= 1}
        print(json.dumps({row: res}), flush=True)
finally:
    procs.stop()
    s.upstream.stop()
    import shutil
    shutil.rmtree(s.workdir, ignore_errors=True)
