"""Checks on the Kubernetes manifests.

Each manifest is validated against the Kubernetes schemas (kubernetes-validate, a test
dependency) and built with kustomize (skipped when absent); structural assertions check
what relayd needs: host IPC, the socket directory, probes on the health port, settings
that exist in ``relayd.config``.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from relayd import config
from tests.deploy._files import (
    K8S,
    SETTINGS,
    flag_setting,
    run_tool,
    size_mib,
    tool,
)

# Kubernetes release the manifests are validated against (native gRPC probes: 1.27+).
K8S_VERSION = "1.32.0"


def _k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all_docs() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in _k8s_files():
        for doc in _docs(path):
            yield path, doc


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in _all_docs() if doc["kind"] == kind]


def _only(kind: str) -> dict[str, Any]:
    docs = _by_kind(kind)
    assert len(docs) == 1, f"{len(docs)} {kind}s"
    return docs[0]


def _service(name: str) -> dict[str, Any]:
    (svc,) = [s for s in _by_kind("Service") if s["metadata"]["name"] == name]
    return svc


@pytest.fixture(scope="module")
def daemonset() -> dict[str, Any]:
    return _only("DaemonSet")


@pytest.fixture(scope="module")
def pod(daemonset: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def relayd_container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["containers"] if c["name"] == "relayd"]
    return container


@pytest.fixture(scope="module")
def k8s_settings(tmp_path_factory: pytest.TempPathFactory) -> config.Settings:
    """The ConfigMap's relayd.toml, loaded the way the daemon loads --config."""
    text = _only("ConfigMap")["data"]["relayd.toml"]
    assert "relayd" in tomllib.loads(text)
    path = tmp_path_factory.mktemp("configmap") / "relayd.toml"
    path.write_text(text)
    return config.load(config_file=str(path), environ={})


@pytest.mark.parametrize("path", _k8s_files(), ids=lambda p: p.name)
def test_manifest_matches_kubernetes_schema(path: Path) -> None:
    import kubernetes_validate  # test dependency: pip install kubernetes-validate

    docs = _docs(path)
    assert docs, f"{path.name} is empty"
    for doc in docs:
        assert "namespace" not in doc["metadata"], "manifests are namespace-agnostic"
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no bundled schema; test_servicemonitor checks it
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_is_not_vacuous(daemonset: dict[str, Any]) -> None:
    import kubernetes_validate

    broken = json.loads(json.dumps(daemonset))
    broken["spec"]["template"]["spec"]["hostIPC"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    typo = json.loads(json.dumps(daemonset))
    typo["spec"]["template"]["spec"]["hostIpc"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)


def test_kustomization_lists_the_manifests() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = {r.split("#")[0].strip() for r in kust["resources"]}
    on_disk = {p.name for p in _k8s_files() if not p.name.endswith(".example.yaml")}
    assert listed == on_disk
    # The token template is never applied as-is: no shared placeholder token.
    assert not any("secret" in name.lower() for name in listed)


def test_kustomize_builds() -> None:
    kubectl, kustomize = tool("kubectl"), tool("kustomize")
    if kustomize:
        args = [kustomize, "build", str(K8S)]
    elif kubectl:
        args = [kubectl, "kustomize", str(K8S)]
    else:
        pytest.skip("neither kustomize nor kubectl is installed")
    proc = run_tool(args)
    assert proc.returncode == 0, proc.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(proc.stdout) if d)
    assert kinds == sorted(
        d["kind"] for path, d in _all_docs() if not path.name.endswith(".example.yaml")
    )


def test_daemonset_shares_host_ipc_and_socket_dir(
    pod: dict[str, Any], relayd_container: dict[str, Any], k8s_settings: config.Settings
) -> None:
    assert pod["hostIPC"] is True
    assert not pod.get("hostNetwork", False)
    volumes = {v["name"]: v for v in pod["volumes"]}
    # The arena must be the host's /dev/shm: no volume of any kind over it.
    for container in pod["containers"] + pod.get("initContainers", []):
        for mount in container.get("volumeMounts", []):
            assert not mount["mountPath"].rstrip("/").startswith("/dev/shm"), mount
    for volume in volumes.values():
        assert volume.get("emptyDir", {}).get("medium") != "Memory", volume

    mounts = {m["mountPath"]: m["name"] for m in relayd_container["volumeMounts"]}
    socket_dir = str(Path(k8s_settings.socket).parent)
    assert socket_dir == "/run/relayd"
    host = volumes[mounts[socket_dir]]["hostPath"]
    assert host == {"path": "/run/relayd", "type": "DirectoryOrCreate"}


def test_daemonset_gpu_visibility_without_claiming_gpus(
    pod: dict[str, Any], relayd_container: dict[str, Any]
) -> None:
    for container in pod["containers"] + pod.get("initContainers", []):
        resources = container.get("resources", {})
        for part in ("requests", "limits"):
            assert not any("nvidia.com" in k for k in resources.get(part, {})), container["name"]
    env = {e["name"]: e.get("value") for e in relayd_container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert set(env["NVIDIA_DRIVER_CAPABILITIES"].split(",")) == {"compute", "utility"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["priorityClassName"] == "system-node-critical"


def test_daemonset_flags_probes_and_ports(
    pod: dict[str, Any], relayd_container: dict[str, Any], k8s_settings: config.Settings
) -> None:
    args = relayd_container["args"]
    flags = dict(a.split("=", 1) for a in args)
    for flag in flags:
        assert flag == "--config" or flag_setting(flag) in SETTINGS, flag
    assert flags["--health-address"] == "0.0.0.0:9091"
    assert flags["--metrics-address"] == "0.0.0.0:9090"
    assert flags["--peer-address"] == "$(POD_IP):9092"
    peers_host, _, peers_port = flags["--peers"].partition(":")
    assert peers_host == "relayd-peers.$(POD_NAMESPACE).svc" and peers_port == "9092"
    env_names = {e["name"] for e in relayd_container["env"]}
    for var in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert var in env_names, var

    ports = {p["name"]: p["containerPort"] for p in relayd_container["ports"]}
    assert ports == {"metrics": 9090, "health": 9091, "peer": 9092, "peer-notice": 9093}
    assert ports["peer-notice"] == k8s_settings.peer_notice_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = relayd_container[probe]
        assert set(spec) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert spec["grpc"]["port"] == 9091, probe

    # Config and token files the flags name are what the projected volume provides.
    mounts = {m["name"]: m["mountPath"] for m in relayd_container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    provided = set()
    for name, volume in volumes.items():
        for source in volume.get("projected", {}).get("sources", []):
            for item in next(iter(source.values())).get("items", []):
                provided.add(f"{mounts[name]}/{item['path']}")
    assert flags["--config"] in provided
    assert flags["--peer-token-file"] in provided

    # SIGTERM drains for drain_grace before exiting.
    assert pod["terminationGracePeriodSeconds"] > k8s_settings.drain_grace


def test_daemonset_memory_covers_the_arena(
    relayd_container: dict[str, Any], k8s_settings: config.Settings
) -> None:
    resources = relayd_container["resources"]
    expected = k8s_settings.shm_pool_size // (1 << 20) + 256
    assert size_mib(resources["requests"]["memory"]) == expected
    assert size_mib(resources["limits"]["memory"]) == expected


def test_daemonset_security_context(pod: dict[str, Any], relayd_container: dict[str, Any]) -> None:
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    ctx = relayd_container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert not ctx.get("privileged", False)
    for init in pod.get("initContainers", []):
        caps = init["securityContext"]["capabilities"]
        assert caps["drop"] == ["ALL"]
        assert set(caps.get("add", [])) <= {"CHOWN", "FOWNER"}
    assert pod["automountServiceAccountToken"] is False


def test_services() -> None:
    peers = _service("relayd-peers")
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is True
    assert [p["port"] for p in peers["spec"]["ports"]] == [9092]
    metrics = _service("relayd-metrics")
    assert [p["port"] for p in metrics["spec"]["ports"]] == [9090]
    pod_labels = _only("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    for svc in (peers, metrics):
        assert svc["spec"]["selector"].items() <= pod_labels.items()


def test_servicemonitor() -> None:
    """A CRD, so no bundled schema: check the fields the Prometheus Operator requires."""
    sm = _only("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["name"]
    labels = sm["spec"]["selector"]["matchLabels"]
    metrics = _service("relayd-metrics")
    assert labels.items() <= metrics["metadata"]["labels"].items()
    port_names = {p["name"] for p in metrics["spec"]["ports"]}
    assert sm["spec"]["endpoints"]
    for endpoint in sm["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert set(endpoint) <= {
            "port",
            "path",
            "interval",
            "scrapeTimeout",
            "relabelings",
            "metricRelabelings",
            "scheme",
            "honorLabels",
        }


def test_networkpolicy_fences_peer_ports() -> None:
    policy = _only("NetworkPolicy")
    pod_labels = _only("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["ingress"]
    for rule in spec["ingress"]:
        assert rule.get("from"), f"rule open to every source: {rule}"
        for peer in rule["from"]:
            assert "ipBlock" not in peer or peer["ipBlock"]["cidr"] not in ("0.0.0.0/0", "::/0")
        selectors = [p.get("podSelector", {}).get("matchLabels", {}) for p in rule["from"]]
        only_relayd = all(s.items() <= pod_labels.items() and s for s in selectors)
        if not only_relayd:
            # Everyone else gets the metrics port and nothing more.
            assert [p["port"] for p in rule.get("ports", [])] == ["metrics"], rule
