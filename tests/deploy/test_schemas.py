"""Every object of every rendered overlay of deploy/kubernetes/ against a schema, as `kubectl apply --validate=strict`
would check it on a cluster that has KEDA and the Prometheus operator installed.

- Kubernetes' own kinds (Deployment, StatefulSet, Service, PodDisruptionBudget, ...): the Kubernetes 1.37 JSON schemas
  kubernetes-validate bundles (the newest it has; offline), in strict mode, so an unknown field fails as a
  misspelling would on the API server.
- The custom resources, whose schemas kubernetes-validate does not have: a JSON schema below of the part of each spec
  these manifests use, written from the projects' documented specs, not copied from their CRD files:
  - KEDA `keda.sh/v1alpha1` ScaledObject: https://keda.sh/docs/latest/reference/scaledobject-spec/
  - its `redis-streams` and `redis-cluster-streams` triggers: https://keda.sh/docs/latest/scalers/redis-streams/ and
    https://keda.sh/docs/latest/scalers/redis-cluster-streams/
  - KEDA TriggerAuthentication: https://keda.sh/docs/latest/concepts/authentication/ and
    https://keda.sh/docs/latest/authentication-providers/secret/
  - prometheus-operator `monitoring.coreos.com/v1` ServiceMonitor:
    https://prometheus-operator.dev/docs/api-reference/api/#monitoring.coreos.com/v1.ServiceMonitor
  The fields Kubernetes defines (ObjectMeta, the HPA behavior KEDA passes on, LabelSelector) refer to the bundled
  Kubernetes definitions. Objects are closed (`additionalProperties: false`) as the CRDs' structural schemas are
  under strict field validation, and a trigger's metadata, a map of strings in KEDA's CRD (so numbers must be
  quoted), is further held to the parameters the scaler documents: KEDA ignores a parameter it does not know, so a
  misspelt `lagCount` would scale on something else without a word. A field these manifests start to use needs its
  line here first.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from referencing import Registry, Resource

from .kustomize import render

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "cluster", "monitoring")
KUBERNETES_VERSION = "1.37"
_DEFINITIONS_URL = "https://kubernetes.io/api/_definitions.json"


def _k8s(name: str) -> dict[str, Any]:
    return {"$ref": f"{_DEFINITIONS_URL}#/$defs/io.k8s.{name}"}


def _closed(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": False}


_STRING = {"type": "string", "minLength": 1}
_COUNT = {"type": "string", "pattern": "^[0-9]+$"}  # KEDA parses these as integers from the metadata's strings
_REPLICAS = {"type": "integer", "minimum": 0}

# The parameters each scaler documents; the address ones may instead come from the TriggerAuthentication.
_STREAMS_COMMON = {
    "usernameFromEnv": _STRING,
    "passwordFromEnv": _STRING,
    "stream": _STRING,
    "consumerGroup": _STRING,
    "pendingEntriesCount": _COUNT,
    "streamLength": _COUNT,
    "lagCount": _COUNT,
    "activationLagCount": _COUNT,
    "enableTLS": {"enum": ["true", "false"]},
    "unsafeSsl": {"enum": ["true", "false"]},
}
_SCALER_METADATA = {
    "redis-streams": {"address": _STRING, "host": _STRING, "port": _COUNT, "databaseIndex": _COUNT},
    "redis-cluster-streams": {"addresses": _STRING, "hosts": _STRING, "ports": _STRING},
}
# The scalers' authentication parameters (the pages above, "Authentication Parameters").
_REDIS_AUTH_PARAMETERS = ["address", "addresses", "host", "hosts", "port", "ports", "username", "password"]
_MODES = ("pendingEntriesCount", "streamLength", "lagCount")


def _trigger_metadata(trigger_type: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["stream"],
        "properties": {**_STREAMS_COMMON, **_SCALER_METADATA[trigger_type]},
        "additionalProperties": False,
        # the pending-entries and lag modes read the group's state: both need its name
        "dependentRequired": {
            "pendingEntriesCount": ["consumerGroup"],
            "lagCount": ["consumerGroup"],
            "activationLagCount": ["lagCount"],
        },
        # The three counts are alternative modes: a trigger names one (KEDA reads one, and without any it scales on
        # a default pending count nobody chose).
        "oneOf": [{"required": [mode]} for mode in _MODES],
    }


_TRIGGER = {
    **_closed(
        ["type", "metadata"],
        type={"enum": sorted(_SCALER_METADATA)},
        name=_STRING,
        metadata={"type": "object", "additionalProperties": {"type": "string"}},
        authenticationRef=_closed(["name"], name=_STRING, kind={"enum": ["TriggerAuthentication"]}),
        metricType={"enum": ["AverageValue", "Value", "Utilization"]},
        useCachedMetrics={"type": "boolean"},
    ),
    "allOf": [
        {
            "if": {"properties": {"type": {"const": trigger_type}}},
            "then": {"properties": {"metadata": _trigger_metadata(trigger_type)}},
        }
        for trigger_type in _SCALER_METADATA
    ],
}


def _custom_resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _closed(
        ["apiVersion", "kind", "metadata", "spec"],
        apiVersion={"const": api_version},
        kind={"const": kind},
        metadata=_k8s("apimachinery.pkg.apis.meta.v1.ObjectMeta"),
        spec=spec,
    )


CUSTOM_SCHEMAS: dict[str, dict[str, Any]] = {
    "ScaledObject": _custom_resource(
        "keda.sh/v1alpha1",
        "ScaledObject",
        _closed(
            ["scaleTargetRef", "triggers"],
            scaleTargetRef=_closed(
                ["name"],
                apiVersion=_STRING,
                kind=_STRING,
                name=_STRING,
                envSourceContainerName=_STRING,
            ),
            pollingInterval={"type": "integer", "minimum": 1},
            cooldownPeriod={"type": "integer", "minimum": 0},
            initialCooldownPeriod={"type": "integer", "minimum": 0},
            idleReplicaCount=_REPLICAS,
            minReplicaCount=_REPLICAS,
            maxReplicaCount={"type": "integer", "minimum": 1},
            advanced=_closed(
                [],
                restoreToOriginalReplicaCount={"type": "boolean"},
                horizontalPodAutoscalerConfig=_closed(
                    [], name=_STRING, behavior=_k8s("api.autoscaling.v2.HorizontalPodAutoscalerBehavior")
                ),
            ),
            triggers={"type": "array", "minItems": 1, "items": _TRIGGER},
        ),
    ),
    "TriggerAuthentication": _custom_resource(
        "keda.sh/v1alpha1",
        "TriggerAuthentication",
        _closed(
            [],
            secretTargetRef={
                "type": "array",
                "minItems": 1,
                "items": _closed(
                    ["parameter", "name", "key"], parameter={"enum": _REDIS_AUTH_PARAMETERS}, name=_STRING, key=_STRING
                ),
            },
        ),
    ),
    "ServiceMonitor": _custom_resource(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        _closed(
            ["selector", "endpoints"],
            selector=_k8s("apimachinery.pkg.apis.meta.v1.LabelSelector"),
            endpoints={
                "type": "array",
                "minItems": 1,
                "items": _closed(
                    [],
                    port=_STRING,
                    path={"type": "string", "pattern": "^/"},
                    # prometheus-operator's Duration: number-unit pairs, largest unit first, as Prometheus writes them
                    interval={
                        "type": "string",
                        "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                        "(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                    },
                ),
            },
        ),
    ),
}


def _registry() -> Registry:
    """The bundled Kubernetes definitions, under the URL their own references use."""
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{KUBERNETES_VERSION}.0-local-strict"
    definitions = json.loads((folder / "_definitions.json").read_text())
    return Registry().with_resource(_DEFINITIONS_URL, Resource.from_contents(definitions))


REGISTRY = _registry()


def validate_custom(obj: dict[str, Any]) -> None:
    schema = CUSTOM_SCHEMAS[obj["kind"]]
    jsonschema.Draft202012Validator(schema, registry=REGISTRY).validate(obj)


def rendered(overlay: str) -> list[dict[str, Any]]:
    return render(K8S / "overlays" / overlay)


def one(overlay: str, kind: str) -> dict[str, Any]:
    """A copy of the first object of the kind, for a test to break."""
    return copy.deepcopy(next(o for o in rendered(overlay) if o["kind"] == kind))


def test_the_schemas_are_well_formed_and_the_kubernetes_version_is_the_newest_bundled():
    for schema in CUSTOM_SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    assert kubernetes_validate.latest_version().rsplit(".", 1)[0] == KUBERNETES_VERSION


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_its_schema(overlay):
    kinds = set()
    for obj in rendered(overlay):
        kinds.add(obj["kind"])
        if obj["kind"] in CUSTOM_SCHEMAS:
            validate_custom(obj)
        else:  # a kind kubernetes-validate has no schema for raises SchemaNotFoundError: that fails too
            assert kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "ScaledObject"} <= kinds


def test_a_misspelt_field_of_a_kubernetes_object_fails_in_strict_mode():
    worker = one("cpu", "StatefulSet")
    worker["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 60
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriodSecond"):
        kubernetes_validate.validate(worker, KUBERNETES_VERSION, strict=True)


def test_a_wrongly_typed_field_of_a_kubernetes_object_fails():
    gateway = one("cpu", "Deployment")
    gateway["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gateway, KUBERNETES_VERSION, strict=True)


def _unquote_lag(spec: dict[str, Any]) -> None:
    spec["triggers"][0]["metadata"]["lagCount"] = 4


def _misspell_lag(spec: dict[str, Any]) -> None:
    metadata = spec["triggers"][0]["metadata"]
    metadata["lagcount"] = metadata.pop("lagCount")


def _misspell_type(spec: dict[str, Any]) -> None:
    spec["triggers"][0]["type"] = "redis-stream"


def _drop_group(spec: dict[str, Any]) -> None:
    del spec["triggers"][0]["metadata"]["consumerGroup"]


def _single_node_address(spec: dict[str, Any]) -> None:
    spec["triggers"][0]["metadata"]["address"] = "redis:6379"


def _two_modes(spec: dict[str, Any]) -> None:
    spec["triggers"][0]["metadata"]["pendingEntriesCount"] = "64"


def _no_mode(spec: dict[str, Any]) -> None:
    metadata = spec["triggers"][0]["metadata"]
    del metadata["lagCount"], metadata["activationLagCount"]


def _misspell_min_replicas(spec: dict[str, Any]) -> None:
    spec["minReplicas"] = spec.pop("minReplicaCount")


def _misspell_behavior(spec: dict[str, Any]) -> None:
    spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindow"] = 300


@pytest.mark.parametrize(
    ("overlay", "breakage", "message"),
    [
        ("cpu", _unquote_lag, "4 is not of type 'string'"),
        ("cpu", _misspell_lag, "'lagcount' was unexpected"),
        ("cpu", _misspell_type, "'redis-stream' is not one of"),
        ("cluster", _drop_group, "'consumerGroup' is a dependency of 'lagCount'"),
        ("cluster", _single_node_address, "'address' was unexpected"),
        ("cpu", _two_modes, "is valid under each of"),
        ("cpu", _no_mode, "is not valid under any of"),
        ("gpu", _misspell_min_replicas, "'minReplicas' was unexpected"),
        ("cpu", _misspell_behavior, "'stabilizationWindow' was unexpected"),
    ],
    ids=lambda v: getattr(v, "__name__", None) if callable(v) else None,
)
def test_a_broken_scaled_object_fails(overlay, breakage, message):
    scaled = one(overlay, "ScaledObject")
    validate_custom(scaled)  # intact, it passes
    breakage(scaled["spec"])
    with pytest.raises(jsonschema.ValidationError) as failure:
        validate_custom(scaled)
    assert message in failure.value.message


def test_a_broken_trigger_authentication_or_service_monitor_fails():
    auth = one("cpu", "TriggerAuthentication")
    auth["spec"]["secretTargetRef"][1]["parameter"] = "pasword"
    with pytest.raises(jsonschema.ValidationError, match="pasword"):
        validate_custom(auth)
    monitor = one("monitoring", "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError, match="15 seconds"):
        validate_custom(monitor)
