"""Validates Kubernetes manifests offline, each file's every document, and exits 1 naming the
file, the object and the error of each one that fails (run by scripts/deploy/check in the venv
scripts/deploy/install makes).

- Kubernetes' own kinds: kubernetes-validate's bundled JSON schemas, strict (a field the schema
  does not have is an error, as `kubectl apply --validate=strict` makes it), for each release
  in VERSIONS.
- ServiceMonitor (monitoring.coreos.com/v1, a CRD): the JSON schema of the pydantic model that
  cloudcoil-models-prometheus-operator generates from prometheus-operator's CRD, made strict the
  same way. That model lets any field be null where the CRD says nothing of null; the names,
  types, enums and patterns are the CRD's.
- kustomization.yaml (kustomize's own file, no Kubernetes object): its `resources` must name
  files that exist; it is not validated further.

Usage: python validate.py FILE...
"""

from __future__ import annotations

import functools
import pathlib
import sys
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

# The oldest and the newest Kubernetes releases whose schemas kubernetes-validate bundles.
VERSIONS = ("1.25.0", "1.37.0")
SERVICE_MONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")


def strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists its
    properties and says nothing of others."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@functools.cache
def service_monitor_validator() -> jsonschema.Draft202012Validator:
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    schema = strict(ServiceMonitor.model_json_schema(by_alias=True, mode="validation"))
    # The object must say what it is (the model defaults both).
    schema["required"] = sorted({"apiVersion", "kind", "metadata", "spec", *schema.get("required", [])})
    return jsonschema.Draft202012Validator(schema)


def where(error: jsonschema.ValidationError) -> str:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return path.lstrip(".") or "(top)"


def errors_of(doc: Any) -> list[str]:
    """What is wrong with one document, empty when nothing is."""
    if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
        return ["not a Kubernetes object (no apiVersion and kind)"]
    if (doc["apiVersion"], doc["kind"]) == SERVICE_MONITOR:
        found = sorted(service_monitor_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
        return [f"{where(e)}: {e.message} (prometheus-operator v0.80.1's ServiceMonitor)" for e in found]
    out = []
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            out.append(f"{where(e)}: {e.message} (Kubernetes {e.version})")
        except kubernetes_validate.SchemaNotFoundError as e:
            out.append(e.message)
    return out


def check_file(path: pathlib.Path) -> list[str]:
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        return [f"{path}: cannot be read as YAML: {e}"]
    if not docs:
        return [f"{path}: holds no document"]
    if path.name == "kustomization.yaml":
        missing = [r for r in docs[0].get("resources", []) if not (path.parent / r).exists()]
        return [f"{path}: resources names missing files {missing}"] if missing else []
    out = []
    for doc in docs:
        name = f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}" if isinstance(doc, dict) else "?"
        out += [f"{path}: {name}: {e}" for e in errors_of(doc)]
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    failures, docs = [], 0
    for arg in argv:
        path = pathlib.Path(arg)
        found = check_file(path)
        failures += found
        if not found:
            docs += sum(1 for d in yaml.safe_load_all(path.read_text()) if d is not None)
    for line in failures:
        print(line, file=sys.stderr)
    if failures:
        print(f"{len(failures)} error(s)", file=sys.stderr)
        return 1
    print(f"{len(argv)} files, {docs} documents valid (Kubernetes {' and '.join(VERSIONS)} schemas, strict; "
          "ServiceMonitor: prometheus-operator v0.80.1)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
