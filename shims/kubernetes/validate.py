"""Checks manifests against the Kubernetes schemas bundled in the `kubernetes` Python client
(PyPI, pinned in shims/requirements.txt).

Two checks, both must pass:
- the client's model for the kind (V1Pod, V1Service, ...) is built from the manifest with
  pydantic validation: the models forbid extra keys at every depth and use strict types, so an
  unknown or misspelt field, or a value of the wrong type, is refused with its path;
- the manifest goes through the client's own deserializer and back through its serializer
  (`ApiClient.sanitize_for_serialization`), and must come back unchanged: the deserializer drops
  keys it does not know without a word, so anything dropped or coerced is refused too.

The kubernetes-sigs agent-sandbox `Sandbox` has no schema in any package found (the
`k8s-agent-sandbox` client ships its API group and version, not the CRD): its apiVersion comes from
that package, its embedded pod template is checked as a V1PodSpec as above, and its own top-level
fields are checked only against the list below, read from the project's published API reference.
"""
from __future__ import annotations

from typing import Any

from ..common import ShimError

KINDS = {
    ("v1", "Pod"): "V1Pod",
    ("v1", "Service"): "V1Service",
    ("v1", "Secret"): "V1Secret",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("apps/v1", "Deployment"): "V1Deployment",
}
# agents.x-k8s.io/v1beta1 SandboxSpec, from the agent-sandbox API reference (not from a schema).
SANDBOX_SPEC_FIELDS = {"podTemplate", "volumeClaimTemplates", "service", "lifecycle", "replicas",
                       "operatingMode"}
POD_TEMPLATE_FIELDS = {"spec", "metadata"}
POD_METADATA_FIELDS = {"labels", "annotations"}


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a:
            if k not in b:
                return f"{path}.{k}: dropped by the client (not in its schema)"
            d = _first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        for k in b:
            if k not in a:
                return f"{path}.{k}: added by the client"
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items became {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if a != b or type(a) is not type(b):
        return f"{path}: {a!r} came back as {b!r}"
    return None


def check_model(model_name: str, data: dict, where: str) -> None:
    import pydantic
    from kubernetes import client
    cls = getattr(client, model_name)
    try:
        cls.model_validate(data)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ShimError(f"{where}.{loc}: {err['msg']} ({model_name})") from None
    api = client.ApiClient()
    try:
        obj = api._ApiClient__deserialize(data, model_name)
    except (ValueError, TypeError, pydantic.ValidationError) as e:
        raise ShimError(f"{where}: {model_name} refused it: {e}") from None
    back = api.sanitize_for_serialization(obj)
    diff = _first_difference(data, back, where)
    if diff:
        raise ShimError(diff)


def check_sandbox(doc: dict, where: str) -> None:
    from k8s_agent_sandbox import constants as c
    want = f"{c.SANDBOX_API_GROUP}/{c.SANDBOX_API_VERSION}"
    if doc.get("apiVersion") != want:
        raise ShimError(f"{where}.apiVersion: {doc.get('apiVersion')!r}, the client speaks {want!r}")
    extra = set(doc) - {"apiVersion", "kind", "metadata", "spec"}
    if extra:
        raise ShimError(f"{where}: unknown field(s) {sorted(extra)}")
    check_model("V1ObjectMeta", doc.get("metadata", {}), f"{where}.metadata")
    spec = doc.get("spec")
    if not isinstance(spec, dict) or "podTemplate" not in spec:
        raise ShimError(f"{where}.spec.podTemplate: required")
    extra = set(spec) - SANDBOX_SPEC_FIELDS
    if extra:
        raise ShimError(f"{where}.spec: unknown field(s) {sorted(extra)}")
    if "service" in spec and not isinstance(spec["service"], bool):
        raise ShimError(f"{where}.spec.service: must be a boolean")
    pt = spec["podTemplate"]
    extra = set(pt) - POD_TEMPLATE_FIELDS
    if extra:
        raise ShimError(f"{where}.spec.podTemplate: unknown field(s) {sorted(extra)}")
    meta = pt.get("metadata", {})
    extra = set(meta) - POD_METADATA_FIELDS
    if extra:
        raise ShimError(f"{where}.spec.podTemplate.metadata: unknown field(s) {sorted(extra)}")
    check_model("V1ObjectMeta", meta, f"{where}.spec.podTemplate.metadata")
    check_model("V1PodSpec", pt.get("spec") or {}, f"{where}.spec.podTemplate.spec")
    for i, t in enumerate(spec.get("volumeClaimTemplates", [])):
        check_model("V1PersistentVolumeClaim", {"apiVersion": "v1", "kind": "PersistentVolumeClaim", **t},
                    f"{where}.spec.volumeClaimTemplates[{i}]")


def check_manifest(doc: dict) -> None:
    """Refuses a manifest the cluster's schema would not take as written."""
    if not isinstance(doc, dict):
        raise ShimError("a manifest must be an object")
    kind, version = doc.get("kind"), doc.get("apiVersion")
    name = (doc.get("metadata") or {}).get("name", "?")
    where = f"{kind}/{name}"
    if kind == "Sandbox":
        return check_sandbox(doc, where)
    model = KINDS.get((version, kind))
    if model is None:
        raise ShimError(f"{where}: apiVersion {version!r} kind {kind!r} is not one these shims make")
    check_model(model, doc, where)
