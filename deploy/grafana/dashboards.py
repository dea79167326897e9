#!/usr/bin/env python3
"""Writes Rialto's Grafana dashboards (deploy/grafana/*.json) from this file.

    python3 deploy/grafana/dashboards.py          # rewrite the JSON files
    python3 deploy/grafana/dashboards.py --check  # fail if they are stale, or
                                                  # use a metric or label outside
                                                  # the contract below

The dashboards read the Prometheus metrics every Rialto process serves on
GET /metrics. METRICS is the contract with the code (rialto-core's
metrics.rs): a name or label used here and not listed there fails --check,
which `make k8s-validate` runs. Edit this file, not the JSON.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent

# name -> (type, labels). Histograms expose _bucket (with `le`), _sum, _count.
METRICS: dict[str, tuple[str, set[str]]] = {
    "rialto_http_requests_total": ("counter", {"service", "route", "method", "status"}),
    "rialto_http_request_duration_seconds": ("histogram", {"service", "route", "method", "status"}),
    "rialto_grpc_requests_total": ("counter", {"service", "method", "code"}),
    "rialto_grpc_request_duration_seconds": ("histogram", {"service", "method", "code"}),
    "rialto_limiter_decisions_total": ("counter", {"decision", "limit_type"}),
    "rialto_ledger_holds_total": ("counter", {"outcome"}),
    "rialto_ledger_settlements_total": ("counter", {"outcome"}),
    "rialto_ledger_batch_seconds": ("histogram", set()),
    "rialto_ledger_batch_records": ("histogram", set()),
    "rialto_spend_usd_total": ("counter", {"model"}),
    "rialto_tokens_total": ("counter", {"model", "kind"}),
    "rialto_backend_circuit_state": ("gauge", {"model", "backend"}),
    "rialto_backend_in_flight": ("gauge", {"model", "backend"}),
    "rialto_backend_requests_total": ("counter", {"model", "backend", "outcome"}),
    "rialto_nats_consumer_pending": ("gauge", {"stream", "consumer"}),
    "rialto_log_lines_dropped_total": ("counter", set()),
    # Generation speed, per model and backend (the router).
    "rialto_time_to_first_token_seconds": ("histogram", {"model", "backend"}),
    "rialto_time_per_output_token_seconds": ("histogram", {"model", "backend"}),
    # Each process's database pool: state in_use or idle; the pool's size.
    "rialto_db_pool_connections": ("gauge", {"pool", "state"}),
    "rialto_db_pool_max_connections": ("gauge", {"pool"}),
    # The top N ledger owners by spend since this (billing) process started:
    # a bounded label set, never every account.
    "rialto_top_owner_spend_usd": ("gauge", {"owner"}),
    # Every process: when it started (unix seconds), the build it runs (1),
    # and its configuration and secret-file reloads (applied or refused).
    "rialto_process_start_time_seconds": ("gauge", set()),
    "rialto_build_info": ("gauge", {"revision"}),
    "rialto_config_reloads_total": ("counter", {"outcome"}),
    "rialto_secret_reloads_total": ("counter", {"secret", "outcome"}),
}
# Labels Prometheus adds when it scrapes (kubernetes_sd relabelling, static
# configs), usable in every query.
SCRAPE_LABELS = {"job", "instance", "namespace", "pod"}

DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
HTTP = 'rialto_http_requests_total{namespace=~"$namespace"}'
HTTP_BUCKET = 'rialto_http_request_duration_seconds_bucket{namespace=~"$namespace"}'


def ns(metric: str, matchers: str = "") -> str:
    """`metric{namespace=~"$namespace",<matchers>}`."""
    matchers = matchers.replace("`", '"')  # written with ` inside the f-strings below
    inner = 'namespace=~"$namespace"' + (f",{matchers}" if matchers else "")
    return f"{metric}{{{inner}}}"


def nsm(metric: str, matchers: str = "") -> str:
    """`metric{namespace=~"$namespace",model=~"$model",<matchers>}`: a
    per-model panel, filtered by the board's `$model` variable."""
    return ns(metric, "model=~`$model`" + (f",{matchers}" if matchers else ""))


# The `$model` variable of the boards with per-model panels.
MODEL_VARIABLE = {
    "name": "model", "label": "Model", "type": "query", "datasource": DS,
    "query": {"query": 'label_values(rialto_tokens_total{namespace=~"$namespace"}, model)', "refId": "model"},
    "definition": 'label_values(rialto_tokens_total{namespace=~"$namespace"}, model)',
    "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2, "sort": 1,
    "current": {"text": "All", "value": "$__all"}, "hide": 0,
}


class Board:
    def __init__(self, uid: str, title: str, description: str, variables: list[dict] | None = None) -> None:
        self.uid, self.title, self.description = uid, title, description
        self.variables = variables or []
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0
        self.row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({
            "type": "row", "title": title, "collapsed": False, "panels": [],
            "id": len(self.panels) + 1, "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
        })
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
            self.x, self.row_height = 0, 0

    def _place(self, w: int, h: int) -> dict:
        if self.x + w > 24:
            self._newline()
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_height = max(self.row_height, h)
        return pos

    def panel(self, kind: str, title: str, targets: list[tuple[str, str]], *, w: int = 12,
              h: int = 8, unit: str = "short", description: str = "", instant: bool = False,
              **extra) -> None:
        """A panel; `instant` queries the last value only, as a table (each
        label a column), for table panels."""
        shape = {"instant": True, "range": False, "format": "table"} if instant else {}
        panel = {
            "id": len(self.panels) + 1,
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": self._place(w, h),
            "targets": [
                {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i), **shape}
                for i, (expr, legend) in enumerate(targets)
            ],
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {},
        }
        if kind == "timeseries":
            panel["fieldConfig"]["defaults"]["custom"] = {"fillOpacity": 10, "lineWidth": 1, "showPoints": "never"}
            panel["options"] = {"legend": {"displayMode": "table", "placement": "bottom",
                                           "calcs": ["mean", "max", "lastNotNull"]},
                                "tooltip": {"mode": "multi", "sort": "desc"}}
        elif kind == "stat":
            panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                                "colorMode": "value", "graphMode": "area", "textMode": "auto"}
        for key, value in extra.items():
            if key == "defaults":
                panel["fieldConfig"]["defaults"].update(value)
            elif key == "options":
                panel["options"].update(value)
            else:
                panel[key] = value
        self.panels.append(panel)

    def json(self) -> dict:
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["rialto"],
            "timezone": "browser",
            "editable": True,
            "graphTooltip": 1,
            "refresh": "30s",
            "schemaVersion": 39,
            "version": 1,
            "time": {"from": "now-6h", "to": "now"},
            "links": [{"type": "dashboards", "tags": ["rialto"], "asDropdown": True, "title": "Rialto",
                       "includeVars": True, "keepTime": True}],
            "templating": {"list": [
                {"name": "datasource", "label": "Prometheus", "type": "datasource",
                 "query": "prometheus", "current": {}, "hide": 0},
                {"name": "namespace", "label": "Namespace", "type": "query", "datasource": DS,
                 "query": {"query": "label_values(rialto_http_requests_total, namespace)",
                           "refId": "namespace"},
                 "definition": "label_values(rialto_http_requests_total, namespace)",
                 "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2,
                 "current": {"text": "All", "value": "$__all"}, "hide": 0},
                *self.variables,
            ]},
            "annotations": {"list": []},
            "panels": self.panels,
        }


def quantile(q: str, bucket: str, by: str = "") -> str:
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) (rate({bucket}[{RATE}])))"


def traffic() -> Board:
    b = Board("rialto-traffic", "Rialto / Traffic, latency and errors",
              "Requests through the gateway (HTTP) and between the services (gRPC): volume, latency, errors.")
    b.row("Now")
    b.panel("stat", "Requests/s", [(f"sum(rate({HTTP}[{RATE}]))", "")], w=6, h=4, unit="reqps")
    b.panel("stat", "5xx ratio", [(f'sum(rate({ns("rialto_http_requests_total", "status=~`5..`")}[{RATE}])) / sum(rate({HTTP}[{RATE}]))', "")],
            w=6, h=4, unit="percentunit",
            defaults={"thresholds": {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "orange", "value": 0.01}, {"color": "red", "value": 0.05}]}})
    b.panel("stat", "p95 latency", [(quantile("0.95", HTTP_BUCKET), "")], w=6, h=4, unit="s")
    b.panel("stat", "429s/s", [(f'sum(rate({ns("rialto_http_requests_total", "status=`429`")}[{RATE}]))', "")],
            w=6, h=4, unit="reqps")

    b.row("Traffic")
    b.panel("timeseries", "Requests/s by route", [(f"sum by (route) (rate({HTTP}[{RATE}]))", "{{route}}")], unit="reqps")
    b.panel("timeseries", "Requests/s by status", [(f"sum by (status) (rate({HTTP}[{RATE}]))", "{{status}}")], unit="reqps")
    b.panel("timeseries", "gRPC calls/s by method",
            [(f'sum by (method) (rate({ns("rialto_grpc_requests_total")}[{RATE}]))', "{{method}}")], unit="reqps",
            description="Calls the services serve (auth, limiter, billing, router), from the gateways.")
    b.panel("timeseries", "Requests/s by gateway pod", [(f"sum by (pod) (rate({HTTP}[{RATE}]))", "{{pod}}")],
            unit="reqps", description="Needs the scrape to add a `pod` label (kubernetes_sd relabelling).")

    b.row("Latency")
    b.panel("timeseries", "HTTP latency (all routes)",
            [(quantile(q, HTTP_BUCKET), f"p{int(float(q) * 100)}") for q in ("0.5", "0.95", "0.99")], unit="s")
    b.panel("timeseries", "HTTP p95 by route", [(quantile("0.95", HTTP_BUCKET, "route"), "{{route}}")], unit="s",
            description="Time to the response head: a stream counts until its headers, not its last chunk.")
    b.panel("timeseries", "gRPC p95 by method",
            [(quantile("0.95", ns("rialto_grpc_request_duration_seconds_bucket"), "method"), "{{method}}")], unit="s")
    b.panel("timeseries", "HTTP mean latency by route",
            [(f'sum by (route) (rate({ns("rialto_http_request_duration_seconds_sum")}[{RATE}])) / '
              f'sum by (route) (rate({ns("rialto_http_request_duration_seconds_count")}[{RATE}]))', "{{route}}")],
            unit="s")

    b.row("Errors")
    b.panel("timeseries", "HTTP 5xx/s by route and status",
            [(f'sum by (route, status) (rate({ns("rialto_http_requests_total", "status=~`5..`")}[{RATE}]))',
              "{{route}} {{status}}")], unit="reqps")
    b.panel("timeseries", "HTTP 4xx/s by route and status",
            [(f'sum by (route, status) (rate({ns("rialto_http_requests_total", "status=~`4..`")}[{RATE}]))',
              "{{route}} {{status}}")], unit="reqps",
            description="401 bad keys, 402 no credit, 404 unknown models, 429 rate limits, ...")
    b.panel("timeseries", "gRPC errors/s by method and code",
            [(f'sum by (method, code) (rate({ns("rialto_grpc_requests_total", "code!=`OK`")}[{RATE}]))',
              "{{method}} {{code}}")], unit="reqps")
    b.panel("timeseries", "Error ratio by route (5xx)",
            [(f'sum by (route) (rate({ns("rialto_http_requests_total", "status=~`5..`")}[{RATE}])) / '
              f"sum by (route) (rate({HTTP}[{RATE}]))", "{{route}}")], unit="percentunit")
    return b


def limits_and_spend() -> Board:
    b = Board("rialto-limits-spend", "Rialto / Rate limits, billing and spend",
              "The limiter's decisions, the prepaid ledger's holds and settlements, what is charged, and the NATS usage queue.",
              [MODEL_VARIABLE])
    dec = ns("rialto_limiter_decisions_total")
    spend = nsm("rialto_spend_usd_total")
    b.row("Now")
    b.panel("stat", "Refused by the limiter", [(f'sum(rate({ns("rialto_limiter_decisions_total", "decision=`refused`")}[{RATE}])) / sum(rate({dec}[{RATE}]))', "")],
            w=6, h=4, unit="percentunit")
    b.panel("stat", "Spend, USD per hour", [(f"sum(rate({spend}[{RATE}])) * 3600", "")], w=6, h=4, unit="currencyUSD")
    b.panel("stat", "Spend in the time range, USD", [(f"sum(increase({spend}[$__range]))", "")], w=6, h=4,
            unit="currencyUSD")
    b.panel("stat", "Usage records waiting (NATS)", [(f'sum(max by (stream, consumer) ({ns("rialto_nats_consumer_pending")}))', "")],
            w=6, h=4, unit="short",
            defaults={"thresholds": {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "orange", "value": 100}, {"color": "red", "value": 1000}]}})

    b.row("Rate limits")
    b.panel("timeseries", "Limiter refusals/s by limit type",
            [(f'sum by (limit_type) (rate({ns("rialto_limiter_decisions_total", "decision=`refused`")}[{RATE}]))',
              "{{limit_type}}")], unit="reqps", description="Each refusal is a 429 to the caller.")
    b.panel("timeseries", "Limiter decisions/s", [(f"sum by (decision) (rate({dec}[{RATE}]))", "{{decision}}")],
            unit="reqps")

    b.row("Ledger")
    b.panel("timeseries", "Holds/s by outcome",
            [(f'sum by (outcome) (rate({ns("rialto_ledger_holds_total")}[{RATE}]))', "{{outcome}}")], unit="reqps",
            description="refused: the balance or the key's spending cap could not cover the request (402).")
    b.panel("timeseries", "Settlements/s by outcome",
            [(f'sum by (outcome) (rate({ns("rialto_ledger_settlements_total")}[{RATE}]))', "{{outcome}}")],
            unit="reqps",
            description="queued: billing was unreachable and the usage record went to the durable NATS queue; failed needs a look.")
    b.panel("timeseries", "Ledger writer: batch commit time",
            [(f'histogram_quantile(0.5, sum by (le) (rate({ns("rialto_ledger_batch_seconds_bucket")}[{RATE}])))', "p50"),
             (f'histogram_quantile(0.99, sum by (le) (rate({ns("rialto_ledger_batch_seconds_bucket")}[{RATE}])))', "p99")],
            unit="s",
            description="A settlement waits for the batch that carries it: this is the durable part of a priced request's latency.")
    b.panel("timeseries", "Ledger writer: records per batch",
            [(f'sum(rate({ns("rialto_ledger_batch_records_sum")}[{RATE}])) / sum(rate({ns("rialto_ledger_batch_records_count")}[{RATE}]))', "mean")],
            description="Group commit: how many settlements, durable holds and checkpoints one transaction carries.")

    b.row("Spend and tokens")
    b.panel("timeseries", "Spend, USD per hour by model", [(f"sum by (model) (rate({spend}[{RATE}])) * 3600", "{{model}}")],
            unit="currencyUSD")
    b.panel("bargauge", "Spend in the time range by model, USD",
            [(f"sort_desc(sum by (model) (increase({spend}[$__range])))", "{{model}}")], unit="currencyUSD",
            options={"displayMode": "gradient", "orientation": "horizontal",
                     "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}})
    b.panel("timeseries", "Tokens/s by model and kind",
            [(f'sum by (model, kind) (rate({nsm("rialto_tokens_total")}[{RATE}]))', "{{model}} {{kind}}")], unit="short")
    b.panel("timeseries", "NATS consumer pending", [(f'max by (stream, consumer) ({ns("rialto_nats_consumer_pending")})',
                                                     "{{stream}} / {{consumer}}")], unit="short",
            description="Messages waiting for a durable consumer: usage records that billing has not settled yet.")

    b.row("Top spenders")
    b.panel("table", "Top spenders, USD since their billing replica started",
            [(f'sort_desc(topk(10, sum by (owner) ({ns("rialto_top_owner_spend_usd")})))', "")], w=24, h=9,
            unit="currencyUSD", instant=True,
            description="Each billing replica exports its N largest ledger owners (accounts, wallets) by spend "
                        "since it started: a bounded set, so an owner outside every replica's top N is missing, "
                        "and a restart starts a replica's figures over. Summed over the replicas (an owner that "
                        "moved between them spent on both).",
            options={"showHeader": True, "sortBy": [{"displayName": "USD", "desc": True}]},
            transformations=[{"id": "organize", "options": {
                "excludeByName": {"Time": True},
                "renameByName": {"owner": "Owner", "Value": "USD"}}}])
    return b


def backends() -> Board:
    b = Board("rialto-backends", "Rialto / Backend health",
              "The router's view of each model backend: circuit breakers, load, generation speed, and what "
              "happened to requests.", [MODEL_VARIABLE])
    state = nsm("rialto_backend_circuit_state")
    out = nsm("rialto_backend_requests_total")
    ttft = nsm("rialto_time_to_first_token_seconds_bucket")
    tpot = nsm("rialto_time_per_output_token_seconds_bucket")
    mappings = [{"type": "value", "options": {
        "0": {"text": "closed", "color": "green", "index": 0},
        "1": {"text": "half-open", "color": "yellow", "index": 1},
        "2": {"text": "open", "color": "red", "index": 2},
        "3": {"text": "down", "color": "dark-red", "index": 3}}}]
    b.row("Now")
    b.panel("stat", "Backends open or down", [(f"count(max by (model, backend) ({state}) >= 2) or vector(0)", "")],
            w=8, h=4, defaults={"thresholds": {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "red", "value": 1}]}})
    b.panel("stat", "Requests in flight", [(f'sum({nsm("rialto_backend_in_flight")})', "")], w=8, h=4)
    b.panel("stat", "Failed requests/s (final)", [(f'sum(rate({nsm("rialto_backend_requests_total", "outcome=`final`")}[{RATE}]))', "")],
            w=8, h=4, unit="reqps", description="Requests that failed on their last attempt: the caller got an error.")

    b.row("Circuits")
    b.panel("state-timeline", "Circuit state by backend",
            [(f"max by (model, backend) ({state})", "{{model}} / {{backend}}")], w=24, h=8,
            description="The worst state any router replica sees (each replica keeps its own breakers).",
            defaults={"mappings": mappings, "color": {"mode": "thresholds"},
                      "thresholds": {"mode": "absolute", "steps": [
                          {"color": "green", "value": None}, {"color": "yellow", "value": 1},
                          {"color": "red", "value": 2}, {"color": "dark-red", "value": 3}]}},
            options={"showValue": "auto", "mergeValues": True})

    b.row("Generation")
    b.panel("timeseries", "Time to first token by model and backend",
            [(quantile("0.5", ttft, "model, backend"), "{{model}} / {{backend}} p50"),
             (quantile("0.95", ttft, "model, backend"), "{{model}} / {{backend}} p95")], unit="s",
            description="Streamed answers: from the router's call to the backend to the first token it sent "
                        "(per backend attempt that answered).")
    b.panel("timeseries", "Time per output token by model and backend",
            [(quantile("0.5", tpot, "model, backend"), "{{model}} / {{backend}} p50"),
             (quantile("0.95", tpot, "model, backend"), "{{model}} / {{backend}} p95")], unit="s",
            description="Streamed answers: the time between output tokens after the first.")
    b.panel("timeseries", "Output tokens/s by model",
            [(f'sum by (model) (rate({nsm("rialto_tokens_total", "kind=`completion`")}[{RATE}]))', "{{model}}")],
            w=24, unit="short", description="Completion tokens billed per second: the platform's generation throughput.")

    b.row("Load and outcomes")
    b.panel("timeseries", "In flight by backend",
            [(f'sum by (model, backend) ({nsm("rialto_backend_in_flight")})', "{{model}} / {{backend}}")])
    b.panel("timeseries", "Requests/s by backend and outcome",
            [(f"sum by (backend, outcome) (rate({out}[{RATE}]))", "{{backend}} {{outcome}}")], unit="reqps",
            description="ok; retry (sent again after a failure), failover (moved to another backend), "
                        "skip (the backend refused its credentials), busy (429 or a full queue), final (gave up).")
    b.panel("timeseries", "Retries and failovers/s by model",
            [(f'sum by (model, outcome) (rate({nsm("rialto_backend_requests_total", "outcome=~`retry|failover`")}[{RATE}]))',
              "{{model}} {{outcome}}")], unit="reqps")
    b.panel("timeseries", "Success ratio by backend",
            [(f'sum by (model, backend) (rate({nsm("rialto_backend_requests_total", "outcome=`ok`")}[{RATE}])) / '
              f"sum by (model, backend) (rate({out}[{RATE}]))", "{{model}} / {{backend}}")], unit="percentunit")
    return b


def processes() -> Board:
    b = Board("rialto-processes", "Rialto / Processes, builds and database",
              "Every Rialto process: the build it runs, its restarts, its database pool, and its configuration "
              "and secret reloads.")
    start = ns("rialto_process_start_time_seconds")
    in_use = ns("rialto_db_pool_connections", "state=`in_use`")
    pool_max = ns("rialto_db_pool_max_connections")
    b.row("Now")
    b.panel("stat", "Revisions running", [(f'count(count by (revision) ({ns("rialto_build_info")}))', "")], w=6, h=4,
            description="More than one during a rollout only.",
            defaults={"thresholds": {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "orange", "value": 2}]}})
    b.panel("stat", "Restarts in the last 30 minutes", [(f"sum(changes({start}[30m]))", "")], w=6, h=4,
            defaults={"thresholds": {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "orange", "value": 1}, {"color": "red", "value": 3}]}})
    b.panel("stat", "Fullest database pool", [(f"max({in_use} / ignoring (state) {pool_max})", "")], w=6, h=4,
            unit="percentunit", defaults={"thresholds": {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "orange", "value": 0.75}, {"color": "red", "value": 0.9}]}})
    b.panel("stat", "Reloads refused in the time range",
            [(f'(sum(increase({ns("rialto_config_reloads_total", "outcome=`refused`")}[$__range])) or vector(0)) + '
              f'(sum(increase({ns("rialto_secret_reloads_total", "outcome=`refused`")}[$__range])) or vector(0))', "")],
            w=6, h=4, defaults={"thresholds": {"mode": "absolute", "steps": [
                {"color": "green", "value": None}, {"color": "red", "value": 1}]}})

    b.row("Builds and restarts")
    b.panel("table", "Build revision per pod", [(f'max by (pod, revision) ({ns("rialto_build_info")})', "")],
            instant=True, description="The revision (the build's commit time, as x-rialto-version says it) each pod runs.",
            options={"showHeader": True, "sortBy": [{"displayName": "pod", "desc": False}]},
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}])
    b.panel("timeseries", "Pods by revision", [(f'count by (revision) ({ns("rialto_build_info")})', "{{revision}}")],
            description="A rollout shows as one revision handing over to the next.")
    b.panel("timeseries", "Restarts by pod (30-minute window)",
            [(f"sum by (pod) (changes({start}[30m])) > 0", "{{pod}}")],
            description="Starts of a new process under the same pod (a container restarted in place); the "
                        "RialtoProcessRestarting alert fires at 3.")
    b.panel("timeseries", "Uptime by pod", [(f"time() - max by (pod) ({start})", "{{pod}}")], unit="s")

    b.row("Database pools")
    b.panel("timeseries", "Connections in use vs max by pod and pool",
            [(f"sum by (pod, pool) ({in_use})", "{{pod}} {{pool}} in use"),
             (f"max by (pod, pool) ({pool_max})", "{{pod}} {{pool}} max")],
            description="database.max_connections per process; requests wait for a connection once a pool is full.")
    b.panel("timeseries", "Pool in use, share of max",
            [(f"sum by (pod, pool) ({in_use}) / max by (pod, pool) ({pool_max})", "{{pod}} {{pool}}")],
            unit="percentunit", description="The RialtoDatabasePoolSaturated alert fires at 90% for ten minutes.")
    b.panel("timeseries", "Idle connections by pod and pool",
            [(f'sum by (pod, pool) ({ns("rialto_db_pool_connections", "state=`idle`")})', "{{pod}} {{pool}}")])

    b.row("Reloads")
    b.panel("timeseries", "Configuration reloads by outcome",
            [(f'sum by (outcome) (increase({ns("rialto_config_reloads_total")}[{RATE}]))', "{{outcome}}")],
            description="applied: the changed rialto.toml validated and took effect; refused: it did not, the "
                        "process runs on the previous one (its log says why).")
    b.panel("timeseries", "Secret reloads by secret and outcome",
            [(f'sum by (secret, outcome) (increase({ns("rialto_secret_reloads_total")}[{RATE}]))',
              "{{secret}} {{outcome}}")],
            description="A secret file (mounted Secret) re-read after it changed: applied, or refused (the "
                        "process keeps the previous value).")
    return b


BOARDS = [traffic, limits_and_spend, backends, processes]

NAME = re.compile(r"\b(rialto_[a-z_]+)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def contract_errors(board: dict) -> list[str]:
    """Metric names and labels the board uses that METRICS does not list."""
    errors = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            names = NAME.findall(expr)
            labels = set()
            for name in names:
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                known = METRICS.get(name) or METRICS.get(base)
                if not known or (name != base and known[0] != "histogram" and name not in METRICS):
                    errors.append(f"{board['uid']}: panel {panel['title']!r}: unknown metric {name}")
                    continue
                labels |= known[1] | ({"le"} if name.endswith("_bucket") else set())
            used = set(MATCHER.findall(expr)) | set(LEGEND.findall(target["legendFormat"]))
            for group in GROUPING.findall(expr):
                used |= {label.strip() for label in group.split(",") if label.strip()}
            for label in sorted(used - labels - SCRAPE_LABELS):
                errors.append(f"{board['uid']}: panel {panel['title']!r}: label {label} is not on {names}")
    return errors


def render(board: Board) -> str:
    return json.dumps(board.json(), indent=2, sort_keys=False) + "\n"


def main() -> int:
    check = "--check" in sys.argv[1:]
    failures = []
    for make in BOARDS:
        board = make()
        failures += contract_errors(board.json())
        path = HERE / f"{board.uid}.json"
        text = render(board)
        if check:
            if not path.exists() or path.read_text() != text:
                failures.append(f"{path.name} is stale: run python3 deploy/grafana/dashboards.py")
        else:
            path.write_text(text)
    for failure in failures:
        print(f"dashboards: {failure}", file=sys.stderr)
    if not failures:
        print(f"dashboards: {len(BOARDS)} dashboards, every metric and label in the contract")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
