"""deploy/kubernetes/: every overlay rendered (tests/deploy/kustomize.py, checked against `kubectl kustomize` where
kubectl is installed) and checked against the code it deploys: the stream keys and the group QueueKeys produces, the
worker's probe paths as its metrics server answers them, the grace period against the drain timeout's default, the
images docker/ builds, the Secret references, and a structural check of how the objects refer to each other (selectors,
ports, governing Services), which no schema sees: tests/deploy/test_schemas.py validates each object alone."""

from __future__ import annotations

import dataclasses
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from pagedq.worker.ops.metrics import Metrics
from pagedq.worker.protocol.keys import BANDS, GROUP, QueueKeys
from pagedq.worker.service.config import WorkerSettings

from .kustomize import KUBECTL, render, render_with_kubectl

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "cluster", "monitoring")
WORKLOADS = ("Deployment", "StatefulSet")
SECRETS = {"pagedq-redis": {"url", "password", "address", "addresses"}, "pagedq-api-keys": {"keys"}}


def objects(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    rendered = render(K8S / "overlays" / overlay)
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in rendered}
    assert len(by_name) == len(rendered), "two objects of one kind and name"
    return by_name


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (only,) = obj["spec"]["template"]["spec"]["containers"]
    return only


def env(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def default_of(setting: str) -> float:
    (field,) = [f for f in dataclasses.fields(WorkerSettings) if f.name == setting]
    return float(field.default)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_as_kubectl_renders_it(overlay):
    ours = objects(overlay)
    if KUBECTL:  # the Python merge is checked against the real one wherever there is one
        theirs = {(o["kind"], o["metadata"]["name"]): o for o in render_with_kubectl(K8S / "overlays" / overlay)}
        assert theirs == ours
    expected = {
        ("Deployment", "pagedq-gateway"),
        ("Service", "pagedq-gateway"),
        ("PodDisruptionBudget", "pagedq-gateway"),
        ("StatefulSet", "pagedq-worker"),
        ("Service", "pagedq-worker"),
        ("PodDisruptionBudget", "pagedq-worker"),
        ("ScaledObject", "pagedq-worker"),
        ("TriggerAuthentication", "pagedq-redis"),
    }
    if overlay != "cluster":
        expected |= {("StatefulSet", "pagedq-redis"), ("Service", "pagedq-redis")}
    if overlay == "monitoring":
        expected |= {("ServiceMonitor", "pagedq-worker"), ("ServiceMonitor", "pagedq-gateway")}
    assert set(ours) == expected


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_structure_kubernetes_requires(overlay):
    found = objects(overlay)
    for (kind, name), obj in found.items():
        assert obj["apiVersion"] and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), (kind, name)
        if kind in WORKLOADS:
            spec = obj["spec"]
            pod_labels = spec["template"]["metadata"]["labels"]
            assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
            if kind == "StatefulSet":  # its governing Service must exist, headless
                assert found[("Service", spec["serviceName"])]["spec"]["clusterIP"] == "None"
            for c in spec["template"]["spec"]["containers"]:
                names = {p["name"] for p in c["ports"]}
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    handler = c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("tcpSocket")
                    if handler:
                        assert handler["port"] in names, (name, probe)
        if kind == "Service":
            selected = [
                o
                for o in found.values()
                if o["kind"] in WORKLOADS
                and obj["spec"]["selector"].items() <= o["spec"]["template"]["metadata"]["labels"].items()
            ]
            assert len(selected) == 1, name
            port_names = {p["name"] for p in container(selected[0])["ports"]}
            assert {p["targetPort"] for p in obj["spec"]["ports"]} <= port_names
        if kind == "PodDisruptionBudget":  # it guards the pods of the workload of its name
            workload = next(o for o in found.values() if o["kind"] in WORKLOADS and o["metadata"]["name"] == name)
            assert (
                obj["spec"]["selector"]["matchLabels"].items()
                <= workload["spec"]["template"]["metadata"]["labels"].items()
            )
        if kind == "ServiceMonitor":
            service = found[("Service", name)]
            assert obj["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
            assert {e["port"] for e in obj["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_unprivileged_with_resources_and_no_secret_in_the_manifests(overlay):
    found = objects(overlay)
    assert not [key for key in found if key[0] == "Secret"]  # referenced, never committed
    for (kind, name), obj in found.items():
        if kind not in WORKLOADS:
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in SECRETS[ref["name"]], (name, var["name"])
                else:  # a literal: never a URL with a password, never a password
                    assert "PASSWORD" not in var["name"] and "redis://" not in str(var.get("value", "")), var


def test_worker_names_probes_and_grace_period_match_the_worker():
    found = objects("cpu")
    worker = found[("StatefulSet", "pagedq-worker")]
    c, pod = container(worker), worker["spec"]["template"]["spec"]
    variables = env(c)
    # the consumer name is the pod's: stable per ordinal (docs/deployment.md says why a StatefulSet)
    assert variables["PAGEDQ_WORKER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert variables["PAGEDQ_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "pagedq-redis", "key": "url"}
    (metrics_port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"]
    assert int(variables["PAGEDQ_METRICS_PORT"]["value"]) == metrics_port
    assert variables["PAGEDQ_METRICS_ADDR"]["value"] == "0.0.0.0"  # else the kubelet's probes cannot reach it
    drain = float(variables["PAGEDQ_DRAIN_TIMEOUT"]["value"]) if "PAGEDQ_DRAIN_TIMEOUT" in variables else None
    assert pod["terminationGracePeriodSeconds"] > (drain or default_of("drain_timeout_s"))
    assert c["livenessProbe"]["httpGet"]["path"] == "/health" and c["readinessProbe"]["httpGet"]["path"] == "/ready"
    # a Redis outage the worker rides out (it exits by itself after redis_outage_s) is no reason to restart it
    liveness = c["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= default_of("redis_outage_s")

    # The probe paths are ones the worker's metrics server answers (200 or 503 with a reason, never 404)
    metrics = Metrics(0, "default", Redis(port=1))
    try:
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            url = f"http://127.0.0.1:{metrics.port}{c[probe]['httpGet']['path']}"
            try:
                status = urllib.request.urlopen(url, timeout=5).status
            except urllib.error.HTTPError as exc:
                status = exc.code
            assert status in (200, 503), (probe, status)
    finally:
        metrics.close()


def test_gateway_port_probes_and_disruption_budget():
    found = objects("gpu")
    gateway = found[("Deployment", "pagedq-gateway")]
    c = container(gateway)
    assert [p["containerPort"] for p in c["ports"]] == [8000]  # `pagedq serve --port 8000` in the image's CMD
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert env(c)["PAGEDQ_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "pagedq-api-keys"
    assert found[("Service", "pagedq-gateway")]["spec"]["ports"][0]["port"] == 8000
    assert found[("PodDisruptionBudget", "pagedq-gateway")]["spec"]["minAvailable"] < gateway["spec"]["replicas"]


def test_images_are_the_ones_docker_builds_and_the_gpu_overlay_asks_for_a_gpu():
    built = {
        m.group(2): m.group(1)
        for path in (ROOT / "docker").glob("*.Dockerfile")
        if (m := re.search(r"docker build -f docker/(\S+) -t (\S+) \.", path.read_text()))
    }
    cpu, gpu = (container(objects(o)[("StatefulSet", "pagedq-worker")]) for o in ("cpu", "gpu"))
    assert built[cpu["image"]] == "worker-cpu.Dockerfile"
    assert built[gpu["image"]] == "worker-gpu.Dockerfile"
    assert built[container(objects("cpu")[("Deployment", "pagedq-gateway")])["image"]] == "gateway.Dockerfile"
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert {"name": "model", "mountPath": "/models/model", "readOnly": True} in gpu["volumeMounts"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_triggers_name_the_queues_streams_and_group(overlay):
    found = objects(overlay)
    scaled = found[("ScaledObject", "pagedq-worker")]["spec"]
    target = scaled["scaleTargetRef"]
    assert (target["kind"], target["name"]) in found and target["kind"] == "StatefulSet"
    assert "replicas" not in found[(target["kind"], target["name"])]["spec"]  # KEDA's HPA owns the count
    assert scaled["minReplicaCount"] == 0  # a fleet with nothing to do scales to zero
    keys = QueueKeys("default")
    streams = {keys.jobs_of(band) for band in BANDS}
    kind = "redis-cluster-streams" if overlay == "cluster" else "redis-streams"
    lag = [t for t in scaled["triggers"] if "lagCount" in t["metadata"]]
    pending = [t for t in scaled["triggers"] if "pendingEntriesCount" in t["metadata"]]
    assert len(lag) + len(pending) == len(scaled["triggers"])
    for triggers in (lag, pending):
        assert sorted(t["metadata"]["stream"] for t in triggers) == sorted(streams)  # one per band, each once
        for t in triggers:
            assert t["type"] == kind and t["metadata"]["consumerGroup"] == GROUP
            auth = found[("TriggerAuthentication", t["authenticationRef"]["name"])]["spec"]["secretTargetRef"]
            params = {a["parameter"]: (a["name"], a["key"]) for a in auth}
            assert params["password"] == ("pagedq-redis", "password")
            address = "addresses" if overlay == "cluster" else "address"
            assert params[address] == ("pagedq-redis", address)
    for t in lag:  # any waiting job wakes the fleet; every count is a whole number of jobs
        assert t["metadata"]["activationLagCount"] == "0" and int(t["metadata"]["lagCount"]) >= 1
    by_band = {t["metadata"]["stream"]: int(t["metadata"]["lagCount"]) for t in lag}
    # interactive jobs wait for fewer peers than default ones, default ones than bulk ones
    assert by_band[keys.jobs_of("interactive")] < by_band[keys.jobs_of("default")] < by_band[keys.jobs_of("bulk")]
