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
  ones the overlay expects to exist in the cluster, created outside kustomize),
  and a rendered Secret has every key a volume asks of it (but optional ones);
- secrets as files: no RIALTO_<SECTION>__ variable of a Rialto container
  (init containers and the migration Job's included) comes from a
  secretKeyRef; each RIALTO_*_FILE variable names a file that a volume
  mounted in that container provides (a Secret's or projected volume's item);
  and with secrets.refuse_inline, rialto.toml holds no secret (grpc.token,
  operator.token, a password in database.url or migrate_url, a backend's
  api_key), which the binary would refuse;
- network policies (when the render has any): every connection the
  configuration implies is admitted by the egress policies of its source
  and the ingress policies of its destination when that is in the render:
  DNS (kube-dns in kube-system, UDP and TCP 53) from every Rialto pod,
  bus.url from the five services, the database (database-url of a rendered
  Secret, else port 5432 anywhere) from auth, the limiter, billing and the
  migration Job, gRPC from the gateway to every [remote] address and between
  billing replicas, the gateway's web_search.url and crypto RPC nodes,
  billing's x402 facilitator, the router's openai backends, and the OTLP
  endpoint of a pod that has one; and each Rialto pod's metrics port admits
  the namespace `monitoring` and no other (Prometheus).

A host is resolved as in the cluster: a bare name is a Service of the render
(to the pods it selects, on its targetPort), `<pod>.<headless service>` a
StatefulSet pod, `<service>.<namespace>[.svc[.cluster.local]]` a pod of that
namespace (of unknown labels, on the URL's port), an IP address itself, and
any other name an address outside the cluster, which only an ipBlock (or a
rule without `to`) admits.
"""

from __future__ import annotations

import base64
import ipaddress
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


def selects(selector: dict | None, labels: dict | None) -> bool:
    """Whether a label selector matches `labels` (None: labels unknown, which
    only an empty selector is sure to match)."""
    selector = selector or {}
    if labels is None:
        return not selector.get("matchLabels") and not selector.get("matchExpressions")
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


# An address of the cluster's pods (kind's pod range), for ipBlock rules
# matched against a pod; and one outside the cluster, for other names.
POD_ADDRESS = ipaddress.ip_address("10.244.1.10")


class Pod:
    """A pod of a workload (labels, named ports), or of another namespace
    (labels None: unknown), or an address outside the cluster (ip, or
    neither labels nor namespace: some public address)."""

    def __init__(self, name: str, namespace: str | None, labels: dict | None,
                 ports: dict[str, int] | None = None, ip=None, ns_labels: dict | None = None):
        self.name, self.namespace, self.labels = name, namespace, labels
        self.ports = ports or {}
        self.ip = ip
        self.ns_labels = ns_labels if ns_labels is not None else (
            {"kubernetes.io/metadata.name": namespace} if namespace else {})

    @property
    def outside(self) -> bool:
        return self.namespace is None


class Policies:
    """The render's NetworkPolicies, evaluated as the API defines them."""

    def __init__(self, docs: list[dict], namespace: str, ns_labels: dict):
        self.policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        self.namespace, self.ns_labels = namespace, ns_labels

    def _applying(self, pod: Pod, kind: str) -> list[dict]:
        found = []
        for policy in self.policies:
            spec = policy["spec"]
            types = spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))
            if kind in types and selects(spec.get("podSelector"), pod.labels):
                found.append(policy)
        return found

    def _peer(self, peer: dict, other: Pod) -> bool:
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            if other.outside and other.ip is None:
                return True  # some address outside the cluster: the overlay's to choose
            address = other.ip if other.ip is not None else POD_ADDRESS
            cidr = ipaddress.ip_network(block["cidr"])
            return (address.version == cidr.version and address in cidr
                    and not any(address in ipaddress.ip_network(e) for e in block.get("except", [])
                                if ipaddress.ip_network(e).version == address.version))
        if other.outside:
            return False
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"], other.ns_labels):
                return False
        elif other.namespace != self.namespace:
            return False
        return "podSelector" not in peer or selects(peer["podSelector"], other.labels)

    @staticmethod
    def _port(rule: dict, port: int, protocol: str, named: dict[str, int]) -> bool:
        if not rule.get("ports"):
            return True
        for entry in rule["ports"]:
            if entry.get("protocol", "TCP") != protocol:
                continue
            want = entry.get("port")
            if want is None:
                return True
            if isinstance(want, str):
                want = named.get(want)
            if want is not None and want <= port <= entry.get("endPort", want):
                return True
        return False

    def egress(self, source: Pod, dest: Pod, port: int, protocol: str = "TCP") -> bool:
        policies = self._applying(source, "Egress")
        return not policies or any(
            self._port(rule, port, protocol, dest.ports)
            and (not rule.get("to") or any(self._peer(peer, dest) for peer in rule["to"]))
            for policy in policies for rule in policy["spec"].get("egress") or [])

    def ingress(self, dest: Pod, source: Pod, port: int, protocol: str = "TCP") -> bool:
        if dest.outside or dest.namespace != self.namespace or dest.labels is None:
            return True  # not ours to check
        policies = self._applying(dest, "Ingress")
        return not policies or any(
            self._port(rule, port, protocol, dest.ports)
            and (not rule.get("from") or any(self._peer(peer, source) for peer in rule["from"]))
            for policy in policies for rule in policy["spec"].get("ingress") or [])


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
    jobs = {d["metadata"]["name"]: d for d in find("Job")}
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
    secrets = {d["metadata"]["name"]: d for d in find("Secret")}
    for workload in [*workloads.values(), *jobs.values()]:
        spec = workload["spec"]["template"]["spec"]
        refs = set()
        wanted = []  # (secret, key, optional)
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                refs.add(("ConfigMap", volume["configMap"]["name"]))
            sources = [{"secret": {**volume["secret"], "name": volume["secret"]["secretName"]}}] \
                if "secret" in volume else volume.get("projected", {}).get("sources", [])
            for source in sources:
                if "secret" in source:
                    secret = source["secret"]
                    if not secret.get("optional"):
                        refs.add(("Secret", secret["name"]))
                    for item in secret.get("items", []):
                        wanted.append((secret["name"], item["key"], bool(secret.get("optional"))))
                if "configMap" in source:
                    refs.add(("ConfigMap", source["configMap"]["name"]))
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            for env in container.get("env", []):
                source = env.get("valueFrom", {})
                if "secretKeyRef" in source:
                    if not source["secretKeyRef"].get("optional"):
                        refs.add(("Secret", source["secretKeyRef"]["name"]))
                    wanted.append((source["secretKeyRef"]["name"], source["secretKeyRef"]["key"],
                                   bool(source["secretKeyRef"].get("optional"))))
                if "configMapKeyRef" in source:
                    refs.add(("ConfigMap", source["configMapKeyRef"]["name"]))
        for kind, name in sorted(refs - names):
            if not (kind == "Secret" and name in external):
                errors.append(f"{workload['metadata']['name']}: {kind} {name} is not in the render")
        for name, key, optional in wanted:
            rendered = secrets.get(name)
            if rendered and not optional and key not in {**rendered.get("data", {}), **rendered.get("stringData", {})}:
                errors.append(f"{workload['metadata']['name']}: Secret {name} has no key {key}")

    errors += secret_file_errors(config, workloads, jobs)
    errors += policy_errors(docs, config, workloads, jobs, services, secrets)

    for error in errors:
        print(f"check_render: {path.name}: {error}", file=sys.stderr)
    if not errors:
        print(f"check_render: {path.name}: replica lists, ports, probes, references, config keys, "
              f"secret files and network policies agree")
    return 1 if errors else 0


def rialto_containers(workloads: dict, jobs: dict):
    """(workload name, pod spec, container) of every container running the
    Rialto image: the five services, their init containers, the Job."""
    for name, workload in [*workloads.items(), *jobs.items()]:
        if name not in [f"rialto-{s}" for s in SERVICES] + ["rialto-migrate"]:
            continue
        spec = workload["spec"]["template"]["spec"]
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            yield name, spec, container


def secret_file_errors(config: dict, workloads: dict, jobs: dict) -> list[str]:
    errors = []
    for name, spec, container in rialto_containers(workloads, jobs):
        where = f"{name} ({container['name']})"
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts = {m["mountPath"].rstrip("/"): m for m in container.get("volumeMounts", [])}
        for env in container.get("env", []):
            var = env["name"]
            if not (var.upper().startswith("RIALTO_") and "__" in var):
                continue
            if "secretKeyRef" in env.get("valueFrom", {}):
                errors.append(f"{where}: {var} comes from a secretKeyRef: mount the Secret and set "
                              f"{var}_FILE (secrets as files, re-read when they change)")
            if not var.upper().endswith("_FILE"):
                continue
            file = env.get("value", "")
            directory, _, base = file.rpartition("/")
            mount = mounts.get(directory)
            volume = volumes.get(mount["name"]) if mount else None
            if volume is None:
                errors.append(f"{where}: {var}={file}: no volume is mounted at {directory}")
                continue
            sources = [volume["secret"]] if "secret" in volume else [
                s.get("secret") or s.get("configMap") or {} for s in volume.get("projected", {}).get("sources", [])]
            paths = [item["path"] for source in sources for item in source.get("items", [])]
            if sources and paths and base not in paths:
                errors.append(f"{where}: {var}={file}: the volume {mount['name']} has no item {base}")

    if config.get("secrets", {}).get("refuse_inline"):
        inline = []
        for section in ("grpc", "operator"):
            if config.get(section, {}).get("token"):
                inline.append(f"{section}.token")
        for key in ("url", "migrate_url"):
            url = config.get("database", {}).get(key) or ""
            if urlsplit(url).password:
                inline.append(f"database.{key} (its password)")
        for model in config.get("models", []):
            for i, backend in enumerate(model.get("backends", [])):
                if backend.get("api_key"):
                    inline.append(f"models {model.get('id')!r} backend {backend.get('name', i)}: api_key")
        for key in inline:
            errors.append(f"rialto.toml: {key} is written inline, which secrets.refuse_inline refuses")
    return errors


def policy_errors(docs: list[dict], config: dict, workloads: dict, jobs: dict, services: dict,
                  secrets: dict) -> list[str]:
    if not any(d["kind"] == "NetworkPolicy" for d in docs):
        return []
    namespace = next((d["metadata"]["namespace"] for d in docs if d["metadata"].get("namespace")), "default")
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    for d in docs:
        if d["kind"] == "Namespace" and d["metadata"]["name"] == namespace:
            ns_labels.update(d["metadata"].get("labels", {}))
    policies = Policies(docs, namespace, ns_labels)

    pods: dict[str, Pod] = {}
    for name, workload in [*workloads.items(), *jobs.items()]:
        spec = workload["spec"]["template"]["spec"]
        ports = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", []) if "name" in p}
        pods[name] = Pod(name, namespace, workload["spec"]["template"]["metadata"].get("labels", {}), ports,
                         ns_labels=ns_labels)

    def resolve(url: str, default_port: int | None = None) -> list[tuple[Pod, int]]:
        parts = urlsplit(url if "//" in url else f"tcp://{url}")
        host = parts.hostname or ""
        port = parts.port or {"http": 80, "https": 443, "postgres": 5432, "postgresql": 5432,
                              "nats": 4222}.get(parts.scheme) or default_port
        try:
            return [(Pod(host, None, None, ip=ipaddress.ip_address(host)), port)]
        except ValueError:
            pass
        labels = host.split(".")
        service, other_ns = None, None
        if len(labels) == 1:
            service = services.get(host)
        elif len(labels) == 2 and services.get(labels[1], {}).get("spec", {}).get("clusterIP") == "None":
            service = services[labels[1]]  # <pod>.<headless service>
        elif len(labels) == 2 or labels[2:] in (["svc"], ["svc", "cluster", "local"]):
            if labels[1] == namespace:
                service = services.get(labels[0])
            else:
                other_ns = labels[1]
        if service is not None:
            found = []
            for pod in pods.values():
                if selects({"matchLabels": service["spec"].get("selector", {})}, pod.labels):
                    for entry in service["spec"]["ports"]:
                        if entry["port"] == port:
                            target = entry.get("targetPort", port)
                            found.append((pod, pod.ports.get(target) if isinstance(target, str) else target))
            return found or [(Pod(host, namespace, None, ns_labels=ns_labels), port)]
        if other_ns:
            return [(Pod(host, other_ns, None), port)]
        return [(Pod(host, None, None), port)]  # outside the cluster

    errors = []

    def expect(source: str, what: str, url: str, protocol: str = "TCP", default_port: int | None = None) -> None:
        src = pods.get(source)
        if src is None:
            return
        for dest, port in resolve(url, default_port):
            if port is None:
                continue
            if not policies.egress(src, dest, port, protocol):
                errors.append(f"network policies: {source} may not reach {what} ({url}, {protocol} {port}): "
                              f"no egress rule admits it")
            elif not policies.ingress(dest, src, port, protocol):
                errors.append(f"network policies: {dest.name} does not admit {source} on {protocol} {port} "
                              f"({what}): no ingress rule admits it")

    rialto = [f"rialto-{s}" for s in SERVICES]
    dns = Pod("kube-dns", "kube-system", {"k8s-app": "kube-dns"})
    for name in [*rialto, "rialto-migrate"]:
        if name in pods:
            for protocol in ("UDP", "TCP"):
                if not policies.egress(pods[name], dns, 53, protocol):
                    errors.append(f"network policies: {name} may not reach the cluster DNS (kube-dns, {protocol} 53)")
    if config.get("bus", {}).get("url"):
        for name in rialto:
            expect(name, "bus.url", config["bus"]["url"])
    rialto_secrets = next((s for n, s in secrets.items() if re.fullmatch(r"rialto-secrets(-[a-z0-9]{10})?", n)), {})
    database = rialto_secrets.get("data", {}).get("database-url")
    database = base64.b64decode(database).decode() if database else "postgres://db.example.internal:5432"
    for name in ("rialto-auth", "rialto-limiter", "rialto-billing", "rialto-migrate"):
        expect(name, "the database", database)
    remote = config.get("remote", {})
    for service in ("auth", "limiter", "billing", "router"):
        for address in (a.strip() for a in remote.get(service, "").split(",") if a.strip()):
            expect("rialto-gateway", f"remote.{service}", address)
            if service == "billing":
                expect("rialto-billing", "remote.billing (another replica)", address)
    gateway = workloads.get("rialto-gateway")
    search = dict(config.get("web_search", {}))
    if gateway:
        for env in gateway["spec"]["template"]["spec"]["containers"][0].get("env", []):
            if env["name"].upper().startswith("RIALTO_WEB_SEARCH__") and "value" in env:
                search[env["name"][len("RIALTO_WEB_SEARCH__"):].lower()] = env["value"]
    if search.get("provider") == "searxng" and search.get("url"):
        expect("rialto-gateway", "web_search.url", search["url"])
    for network in config.get("crypto_rpc", {}).get("networks", []):
        for url in network.get("urls", []):
            expect("rialto-gateway", f"crypto_rpc {network.get('slug')}", url)
    if config.get("x402", {}).get("facilitator_url"):
        expect("rialto-billing", "x402.facilitator_url", config["x402"]["facilitator_url"])
    for model in config.get("models", []):
        for backend in model.get("backends", []):
            if backend.get("kind") == "openai" and backend.get("url"):
                expect("rialto-router", f"model {model.get('id')}'s backend {backend.get('name', '')}", backend["url"])
    for name in rialto:
        workload = workloads.get(name)
        if not workload:
            continue
        for env in workload["spec"]["template"]["spec"]["containers"][0].get("env", []):
            if env["name"] == "OTEL_EXPORTER_OTLP_ENDPOINT" and "value" in env:
                expect(name, "the OTLP endpoint", env["value"])

    prometheus = Pod("prometheus", "monitoring", None)
    elsewhere = Pod("elsewhere", "some-other-namespace", None)
    metrics = port_of(config["metrics"]["listen"]) if config.get("metrics", {}).get("listen") else None
    for name in rialto:
        if metrics is None or name not in pods:
            continue
        if not policies.ingress(pods[name], prometheus, metrics):
            errors.append(f"network policies: {name} does not admit the namespace monitoring on its metrics port {metrics}")
        if policies.ingress(pods[name], elsewhere, metrics) and policies._applying(pods[name], "Ingress"):
            errors.append(f"network policies: {name} admits any namespace on its metrics port {metrics}, "
                          f"not the namespace monitoring alone")
    return errors


if __name__ == "__main__":
    sys.exit(main())
