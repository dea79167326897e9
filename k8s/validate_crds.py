#!/usr/bin/env python3
"""Validates a render's custom resources against their CRDs, offline.

    validate_crds.py RENDERED.yaml OTHERS.yaml

kubernetes-validate knows the built-in kinds only: given a PodMonitor or a
PrometheusRule it warns that it has no schema and passes it. `make
k8s-validate` therefore runs this first: every object of a kind whose
CustomResourceDefinition is in k8s/crds/ is validated here against the CRD's
openAPIV3Schema, made strict as kubernetes-validate --strict is (an unknown
field is an error, except where the schema preserves unknown fields), with
its metadata checked against Kubernetes' ObjectMeta (the strict schema
kubernetes-validate bundles). Every other object is written to OTHERS.yaml,
for kubernetes-validate --strict; an object of a CRD's group with no schema
here fails. So every rendered object is validated by one or the other.
"""

from __future__ import annotations

import copy
import pathlib
import sys

import jsonschema
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

ROOT = pathlib.Path(__file__).resolve().parent
CRDS = ROOT / "crds"
# The Kubernetes version of kubernetes-validate's schemas (K8S_VERSION).
KUBERNETES = "1.37.0"
OBJECT_META = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def strict(schema: dict) -> dict:
    """The schema with `additionalProperties: false` wherever it lists
    properties and neither allows others nor preserves unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def load_crds() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the strict JSON schema of each CRD version."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schema = strict(version["schema"]["openAPIV3Schema"])
                schema["properties"]["metadata"] = {"$ref": OBJECT_META}
                schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
                schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def main() -> int:
    rendered, others = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    schemas = load_crds()
    groups = {api_version.split("/")[0] for api_version, _ in schemas}
    definitions = Resource.from_contents(schema_contents(
        f"kubernetes-json-schema/v{KUBERNETES}-local-strict/_definitions.json", KUBERNETES))
    registry = definitions @ Registry()

    docs = [d for d in yaml.safe_load_all(rendered.read_text()) if d]
    rest, errors, checked = [], [], {}
    for doc in docs:
        key = (doc.get("apiVersion", ""), doc.get("kind", ""))
        name = f"{key[1]} {doc.get('metadata', {}).get('name')}"
        if key in schemas:
            validator = jsonschema.Draft202012Validator(schemas[key], registry=registry)
            for error in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
                where = "/".join(str(p) for p in error.absolute_path) or "(root)"
                errors.append(f"{name}: {where}: {error.message}")
            checked[key[1]] = checked.get(key[1], 0) + 1
        elif key[0].split("/")[0] in groups:
            errors.append(f"{name}: no schema for {key[0]} {key[1]} in k8s/crds/")
        else:
            rest.append(doc)
    others.write_text(yaml.safe_dump_all(rest, sort_keys=False))
    for error in errors:
        print(f"validate_crds: {rendered.name}: {error}", file=sys.stderr)
    if errors:
        return 1
    if checked:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(checked.items()))
        print(f"validate_crds: {rendered.name}: {kinds} valid against k8s/crds/ (strict)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
