"""deploy/ says what the server really does: flags, ports, probe routes, drain time, metrics."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rtc_server.app import create_app
from rtc_server.cli import build_parser
from rtc_server.config import ServerConfig
from rtc_server.metrics import Metrics
from rtc_server.options import SERVE_OPTIONS, config_from, env_default, option

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
YAML_FILES = sorted([*DEPLOY.glob("*.yml"), *DEPLOY.glob("*.yaml"), *K8S.glob("*.yaml")])
SAMPLE = {
    "PUBLIC_IP": "127.0.0.1",
    "HOST_IP": "127.0.0.1",
    "TURN_SECRET": "sample-turn-secret-0123456789abcdef",
    "API_KEY": "sample-api-key-0123456789abcdefghij",
}
"""Values for the variables the files interpolate (compose ${VAR}, Kubernetes $(VAR))."""


def _load(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _one(path: Path) -> Any:
    (doc,) = _load(path)
    return doc


def _by_kind(kind: str) -> Any:
    found = [d for p in K8S.glob("*.yaml") for d in _load(p) if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/k8s"
    return found[0]


def _interpolate(value: str) -> str:
    value = re.sub(r"\$\{(\w+)(?:[:?-][^}]*)?\}", lambda m: SAMPLE.get(m.group(1), ""), value)
    return re.sub(r"\$\((\w+)\)", lambda m: SAMPLE.get(m.group(1), ""), value)


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser({})
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = sub.choices["serve"]
    return serve


def _env_flags() -> dict[str, str]:
    """AVATAR_RTC_<FLAG> name -> flag, for every serve option (the options table)."""
    return {o.env: o.flag for o in SERVE_OPTIONS}


def _compose_env() -> dict[str, str]:
    env = _one(DEPLOY / "docker-compose.yml")["services"]["avatar-rtc"]["environment"]
    return {k: _interpolate(str(v)) for k, v in env.items()}


def _container() -> Any:
    (container,) = _by_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _k8s_env() -> dict[str, str]:
    return {
        e["name"]: _interpolate(str(e.get("value", SAMPLE.get("TURN_SECRET"))))
        for e in _container()["env"]
    }


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    assert _load(path), f"{path} is empty"


def test_the_env_var_lookup_knows_the_cli() -> None:
    flags = _env_flags()
    for name in ("AVATAR_RTC_PORT", "AVATAR_RTC_ICE_ADDRESS", "AVATAR_RTC_DRAIN_TIMEOUT_S"):
        assert name in flags
    assert "AVATAR_RTC_VERBOSE" not in flags  # a flag, but not one the environment sets


@pytest.mark.parametrize("source", ["compose", "k8s"])
def test_env_vars_are_real_flags_with_valid_values(source: str) -> None:
    env = _compose_env() if source == "compose" else _k8s_env()
    used = {k for k in env if k.startswith("AVATAR_RTC_")}
    unknown = used - set(_env_flags())
    assert not unknown, f"{source} sets variables no flag reads: {sorted(unknown)}"
    # The values parse as the CLI parses them, and the configuration they make is valid.
    config = config_from(build_parser(env).parse_args(["serve"]), env)
    assert config.media.turn_urls == tuple(env_default(option("turn-url"), env))


def _routes() -> set[str]:
    app = create_app(ServerConfig.of(ice_addresses=("127.0.0.1",)))
    return {r.canonical for r in app.router.resources()}


def test_compose_serves_what_it_publishes() -> None:
    compose = _one(DEPLOY / "docker-compose.yml")
    server = compose["services"]["avatar-rtc"]
    assert server["build"] == {"context": "..", "dockerfile": "Dockerfile.gpu"}
    assert (DEPLOY / server["build"]["context"]).resolve() == DEPLOY.parent
    args = build_parser(_compose_env()).parse_args(["serve"])
    assert args.host == "0.0.0.0"
    published = {p.rsplit(":", 1)[1] for p in server["ports"]}
    assert f"{args.port}/tcp" in published
    # The UDP range Docker forwards is the range the server's sockets are bound in.
    low, high = server["sysctls"]["net.ipv4.ip_local_port_range"].split()
    assert f"{low}-{high}/udp" in published
    health = " ".join(server["healthcheck"]["test"])
    assert f"127.0.0.1:{args.port}/healthz" in health and "/healthz" in _routes()
    # Docker waits longer than the drain before it kills the server, and the signal gets there.
    grace = server["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > args.drain_timeout_s
    assert server["init"] is True and server.get("stop_signal", "SIGTERM") == "SIGTERM"
    gpu = server["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and gpu["count"] == 1
    assert server["entrypoint"] == ["avatar-rtc"] and server["command"] == ["serve"]


def _turn_conf() -> dict[str, str]:
    conf: dict[str, str] = {}
    for line in (DEPLOY / "turnserver.conf").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            conf[key] = value
    return conf


def test_coturn_checks_the_credentials_the_server_mints() -> None:
    conf = _turn_conf()
    assert "use-auth-secret" in conf and conf["static-auth-secret"]
    compose = _one(DEPLOY / "docker-compose.yml")
    coturn = compose["services"]["coturn"]
    server_env = compose["services"]["avatar-rtc"]["environment"]
    # One secret for both: the server's --turn-secret is coturn's static-auth-secret.
    secret_var = re.fullmatch(r"\$\{(\w+)[^}]*\}", server_env["AVATAR_RTC_TURN_SECRET"])
    assert secret_var is not None
    assert any(
        a.startswith("--static-auth-secret=${" + secret_var.group(1)) for a in coturn["command"]
    )
    # With TURN on, calls need tokens: compose refuses to start without an API key.
    assert server_env["AVATAR_RTC_API_KEY"].startswith("${API_KEY:?")
    assert "/etc/coturn/turnserver.conf" in coturn["command"]
    assert any(v.startswith("./turnserver.conf:") for v in coturn["volumes"])
    # The TURN URLs handed to browsers name coturn's port.
    urls = env_default(option("turn-url"), _compose_env())
    assert urls and all(f":{conf['listening-port']}?" in u for u in urls)
    assert int(conf["min-port"]) < int(conf["max-port"])


def test_kubernetes_deployment_matches_the_server() -> None:
    deployment = _by_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _container()
    args = build_parser(_k8s_env()).parse_args(["serve"])
    assert container["command"] == ["avatar-rtc"] and container["args"] == ["serve"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    (port,) = container["ports"]
    assert port["containerPort"] == args.port and port["protocol"] == "TCP"
    routes = _routes()
    probes = {
        kind: container[kind]["httpGet"]
        for kind in ("livenessProbe", "readinessProbe", "startupProbe")
    }
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["startupProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    for probe in probes.values():
        assert probe["path"] in routes
        assert probe["port"] in (port["name"], port["containerPort"])
    assert pod["terminationGracePeriodSeconds"] > args.drain_timeout_s
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "avatar-rtc/session-affinity" in deployment["metadata"]["annotations"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    # Metrics on a listener of their own, on the node's address: not behind the Ingress.
    assert args.metrics_port and args.metrics_port != args.port
    assert args.metrics_host == "127.0.0.1"  # $(HOST_IP), as SAMPLE spells it
    assert annotations["prometheus.io/port"] == str(args.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert all(p["containerPort"] != args.metrics_port for p in container["ports"])


def test_the_pod_runs_unprivileged_on_a_read_only_root() -> None:
    pod = _by_kind("Deployment")["spec"]["template"]["spec"]
    container = _container()
    uid = re.search(r"useradd .*--uid (\d+) avatar", (ROOT / "Dockerfile.gpu").read_text())
    assert uid is not None
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == int(uid.group(1))
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["privileged"] is False
    assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"]
    # What it writes has somewhere to go: /tmp (HOME, TMPDIR) and the cache volume.
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "/tmp" in mounts and env["HOME"] == env["TMPDIR"] == "/tmp"
    assert any(env["AVATAR_RTC_CACHE_DIR"].startswith(m) for m in mounts - {"/tmp"})


def test_compose_services_are_hardened_and_prometheus_is_local() -> None:
    services = _one(DEPLOY / "docker-compose.yml")["services"]
    for name in ("avatar-rtc", "coturn", "prometheus"):
        service = services[name]
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"] and "cap_add" not in service, name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert not service.get("privileged"), name
    server = services["avatar-rtc"]
    assert "/tmp" in server["tmpfs"] and server["environment"]["HOME"] == "/tmp"
    for port in services["prometheus"]["ports"]:
        assert str(port).startswith("127.0.0.1:"), port


def test_service_ingress_and_budget_point_at_the_pods() -> None:
    labels = _by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = _by_kind("Service")
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in ("http", _container()["ports"][0]["containerPort"])
    assert service["spec"]["sessionAffinity"] == "ClientIP"
    ingress = _by_kind("Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == service["metadata"]["name"]
    assert backend["port"]["name"] == port["name"]
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/affinity"] == "cookie"
    budget = _by_kind("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


def _gauges() -> set[str]:
    return {m.name for m in Metrics().registry.collect() if m.type == "gauge"}


def test_autoscaling_reads_a_metric_the_server_exports() -> None:
    hpa = _by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == _by_kind("Deployment")["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name in _gauges()
    # The Prometheus adapter serves exactly that name, from that series.
    rules = _one(K8S / "prometheus-adapter-values.yaml")["rules"]["custom"]
    assert any(r["name"]["as"] == name and r["seriesQuery"].startswith(name + "{") for r in rules)


def test_prometheus_scrapes_the_metrics_route() -> None:
    compose = _one(DEPLOY / "docker-compose.yml")
    args = build_parser(_compose_env()).parse_args(["serve"])
    (job,) = _one(DEPLOY / "prometheus.yml")["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    # The metrics listener, which compose does not publish: only Prometheus reaches it.
    assert args.metrics_port and args.metrics_host == "0.0.0.0"
    assert job["static_configs"][0]["targets"] == [f"avatar-rtc:{args.metrics_port}"]
    published = [str(p).split(":")[-2] for p in compose["services"]["avatar-rtc"]["ports"]]
    assert str(args.metrics_port) not in published
    assert "avatar-rtc" in compose["services"]
    (k8s_job,) = _one(K8S / "prometheus-scrape-job.yaml")["scrape_configs"]
    targets = {c.get("target_label") for c in k8s_job["relabel_configs"]}
    assert {"namespace", "pod"} <= targets  # what the adapter's seriesQuery needs


def test_the_gpu_image_matches_the_server() -> None:
    """Dockerfile.gpu: its AVATAR_RTC_* settings are real flags, it serves the port it
    exposes, probes /readyz, runs as a non-root user and keeps the weights in a volume."""
    text = (DEPLOY.parent / "Dockerfile.gpu").read_text()
    flags = _env_flags()
    for name in re.findall(r"\b(AVATAR_RTC_[A-Z0-9_]+)=", text):
        assert name in flags, f"Dockerfile.gpu sets {name}, which no serve flag reads"
    port = re.search(r"AVATAR_RTC_PORT=(\d+)", text)
    assert port is not None and f"EXPOSE {port.group(1)}/tcp" in text
    assert re.search(r"HEALTHCHECK .*\n.*127\.0\.0\.1:" + port.group(1) + "/readyz", text)
    assert "/readyz" in _routes()
    assert re.search(r"^USER (?!root)\w+", text, re.M)
    weights = re.search(r"AVATAR_RTC_WEIGHTS_DIR=(\S+)", text)
    assert weights is not None and f'"{weights.group(1)}"' in text.split("VOLUME", 1)[1]
    assert 'ENTRYPOINT ["avatar-rtc"]' in text  # exec form: SIGTERM reaches the server
    assert "onnxruntime-gpu" in text and '".[stt,gpu]"' in text
