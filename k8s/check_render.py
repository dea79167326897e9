#!/usr/bin/env python3
"""Checks a rendered overlay for what the Kubernetes schemas cannot see.

    check_render.py RENDERED.yaml OVERLAY_DIR

`make k8s-validate` runs it on every overlay after kubernetes-validate. It
reads the rialto.toml of the rialto-config ConfigMap and checks it against
the manifests:

- each limiter and billing pod advertises its own entry of that list
  (RIALTO_GRPC__ADVERTISE: http://$(POD_NAME).<headless service>:<port>);
- remote.limiter and remote.billing list exactly one address per replica of
  their StatefulSet, in order, by pod name under its headless Service
  (http://rialto-limiter-0.rialto-limiter:9090, ...);
- every other host named in [remote] and bus.url without a dot is a Service
  of the render, on that port; so is web_search.url's host when the
  gateway's provider is searxng (its [web_search] is rialto.toml's under the
  gateway's RIALTO_WEB_SEARCH__* variables, which win, as in the binary),
  and that URL is http(s);
- every RIALTO_<SECTION>__<KEY> variable of a Rialto container names a
  top-level key of the binary (it ignores the others without a word);
- the ports: gateway.listen is the gateway's http port, grpc.listen the
  other services' grpc port and their gRPC probes', metrics.listen every
  pod's metrics port and prometheus.io/port;
- the top-level keys of rialto.toml are ones the binary knows
  (TOP_LEVEL_KEYS in crates/rialto-core/src/config.rs);
- every ConfigMap and Secret a workload references is in the render, except
  the Secrets listed in OVERLAY_DIR/external-secrets (one name a line: the
  ones the overlay expects to exist in the cluster, created outside kustomize).
"""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib
from urllib.parse import urlsplit

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ["gateway", "auth", "router", "limiter", "billing"]


def top_level_keys() -> set[str]:
    source = (ROOT / "crates/rialto-core/src/config.rs").read_text()
    match = re.search(r"const TOP_LEVEL_KEYS: \[&str; \d+\] = \[(.*?)\];", source, re.S)
    if not match:
        raise SystemExit("check_render: TOP_LEVEL_KEYS not found in config.rs")
    return set(re.findall(r'"([a-z0-9_]+)"', match.group(1)))


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def main() -> int:
    path, overlay = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    external = set()
    if (overlay / "external-secrets").exists():
        for line in (overlay / "external-secrets").read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                external.add(line)
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    errors: list[str] = []

    def find(kind: str, name: str | None = None, prefix: bool = False) -> list[dict]:
        found = []
        for d in docs:
            if d["kind"] != kind:
                continue
            actual = d["metadata"]["name"]
            if name is None or actual == name or (prefix and re.fullmatch(re.escape(name) + r"-[a-z0-9]{10}", actual)):
                found.append(d)
        return found

    configs = find("ConfigMap", "rialto-config", prefix=True)
    if len(configs) != 1:
        print(f"check_render: {path.name}: expected one rialto-config ConfigMap, found {len(configs)}", file=sys.stderr)
        return 1
    config = tomllib.loads(configs[0]["data"]["rialto.toml"])
    known = top_level_keys()
    for key in sorted(set(config) - known):
        errors.append(f"rialto.toml: unknown top-level key {key!r} (the binary would refuse it)")

    workloads = {}
    for kind in ("Deployment", "StatefulSet"):
        for d in find(kind):
            workloads[d["metadata"]["name"]] = d
    services = {d["metadata"]["name"]: d for d in find("Service")}

    remote = config.get("remote", {})
    for service in ("limiter", "billing"):
        name = f"rialto-{service}"
        sts = workloads.get(name)
        if not sts or sts["kind"] != "StatefulSet":
            errors.append(f"{name}: no StatefulSet")
            continue
        headless = sts["spec"]["serviceName"]
        if services.get(headless, {}).get("spec", {}).get("clusterIP") != "None":
            errors.append(f"{name}: serviceName {headless} is not a headless Service of the render")
        port = port_of(config.get("grpc", {}).get("listen", "127.0.0.1:9090"))
        expected = [f"http://{name}-{i}.{headless}:{port}" for i in range(sts["spec"].get("replicas", 1))]
        listed = [a.strip() for a in remote.get(service, "").split(",") if a.strip()]
        if listed != expected:
            errors.append(f"remote.{service} lists {listed}, but the StatefulSet's replicas are {expected}")
        # Each pod names itself as the list does (its heartbeats, failover).
        containers = sts["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for c in containers for e in c.get("env", [])}
        advertised = f"http://$(POD_NAME).{headless}:{port}"
        if env.get("RIALTO_GRPC__ADVERTISE") != advertised or "POD_NAME" not in env:
            errors.append(
                f"{name}: RIALTO_GRPC__ADVERTISE must be {advertised} (POD_NAME from "
                f"metadata.name), its entry in remote.{service}"
            )

    hosts = [(f"remote.{s}", remote[s]) for s in ("auth", "router") if s in remote]
    if config.get("bus", {}).get("url"):
        hosts.append(("bus.url", config["bus"]["url"]))

    # The gateway's [web_search]: rialto.toml's, under its variables.
    search = dict(config.get("web_search", {}))
    gateway = workloads.get("rialto-gateway")
    if gateway:
        for env in gateway["spec"]["template"]["spec"]["containers"][0].get("env", []):
            prefix = "RIALTO_WEB_SEARCH__"
            if env["name"].upper().startswith(prefix) and "value" in env:
                search[env["name"][len(prefix):].lower()] = env["value"]
    if search.get("provider") == "searxng":
        url = search.get("url", "")
        if urlsplit(url).scheme not in ("http", "https"):
            errors.append(f"web_search.url = {url!r}: not the SearXNG instance's http(s) base URL")
        else:
            hosts.append(("web_search.url", url))

    for key, url in hosts:
        parts = urlsplit(url)
        if "." in (parts.hostname or ""):
            continue  # outside the render (another namespace, or outside the cluster)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        service = services.get(parts.hostname)
        if not service:
            errors.append(f"{key} = {url}: no Service {parts.hostname} in the render")
        elif port not in [p["port"] for p in service["spec"]["ports"]]:
            errors.append(f"{key} = {url}: Service {parts.hostname} has no port {port}")

    for service in SERVICES:
        workload = workloads.get(f"rialto-{service}")
        if not workload:
            continue
        for env in workload["spec"]["template"]["spec"]["containers"][0].get("env", []):
            name = env["name"]
            if name.upper().startswith("RIALTO_") and "__" in name:
                section = name[len("RIALTO_"):].split("__", 1)[0].lower()
                if section not in known:
                    errors.append(
                        f"rialto-{service}: {name} names no top-level key of the binary, "
                        f"which ignores it"
                    )

    metrics_port = port_of(config["metrics"]["listen"]) if config.get("metrics", {}).get("listen") else None
    for service in SERVICES:
        name = f"rialto-{service}"
        workload = workloads.get(name)
        if not workload:
            errors.append(f"{name}: missing")
            continue
        template = workload["spec"]["template"]
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        if service == "gateway":
            want = port_of(config.get("gateway", {}).get("listen", "127.0.0.1:8080"))
            if ports.get("http") != want:
                errors.append(f"{name}: port http {ports.get('http')} but gateway.listen's is {want}")
        else:
            want = port_of(config.get("grpc", {}).get("listen", "127.0.0.1:9090"))
            if ports.get("grpc") != want:
                errors.append(f"{name}: port grpc {ports.get('grpc')} but grpc.listen's is {want}")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                grpc = container.get(probe, {}).get("grpc")
                if grpc is None or grpc["port"] != want:
                    errors.append(f"{name}: {probe} is not a gRPC health probe on port {want}")
            if container["args"] != ["serve", "--services", service]:
                errors.append(f"{name}: args {container['args']}")
        annotations = template["metadata"].get("annotations", {})
        if metrics_port is not None:
            if ports.get("metrics") != metrics_port or annotations.get("prometheus.io/port") != str(metrics_port):
                errors.append(f"{name}: metrics port or prometheus.io/port is not metrics.listen's {metrics_port}")

    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for workload in workloads.values():
        spec = workload["spec"]["template"]["spec"]
        refs = set()
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                refs.add(("ConfigMap", volume["configMap"]["name"]))
            if "secret" in volume:
                refs.add(("Secret", volume["secret"]["secretName"]))
        for container in spec["containers"]:
            for env in container.get("env", []):
                source = env.get("valueFrom", {})
                if "secretKeyRef" in source:
                    refs.add(("Secret", source["secretKeyRef"]["name"]))
                if "configMapKeyRef" in source:
                    refs.add(("ConfigMap", source["configMapKeyRef"]["name"]))
        for kind, name in sorted(refs - names):
            if not (kind == "Secret" and name in external):
                errors.append(f"{workload['metadata']['name']}: {kind} {name} is not in the render")

    for error in errors:
        print(f"check_render: {path.name}: {error}", file=sys.stderr)
    if not errors:
        print(f"check_render: {path.name}: replica lists, ports, probes, references and config keys agree")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
