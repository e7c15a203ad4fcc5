"""Static checks of the deployment files: docker-compose.yml, Dockerfile, deploy/k8s, deploy/systemd.

No container engine or cluster runs here, so these parse the files and check the properties the
deployment relies on (docs/deployment.md says what was and was not validated).
"""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
UNIT = ROOT / "deploy" / "systemd" / "toolchord-worker.service"
DEFAULT_QUEUE = "toolchord"


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def k8s_documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (d["metadata"]["name"], d["spec"]["template"]["spec"])
        for d in k8s_documents()
        if d["kind"] in ("Deployment", "StatefulSet")
    ]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    return [(item.split(None, 1)[0].upper(), item.split(None, 1)[1]) for item in logical]


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=True, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser


# -- docker-compose.yml -------------------------------------------------------------------------


def test_compose_has_the_expected_services() -> None:
    services = compose()["services"]
    assert set(services) == {"redis", "worker", "flower", "orchestrator"}
    assert services["orchestrator"]["command"] == ["toolchord", "demo"]


def test_compose_worker_can_scale() -> None:
    worker = compose()["services"]["worker"]
    assert "container_name" not in worker, "a fixed container name breaks --scale worker=N"
    assert "ports" not in worker, "fixed host ports break --scale worker=N"


def test_compose_redis_requires_a_password_and_persists_explicitly() -> None:
    redis = compose()["services"]["redis"]
    command = redis["command"]
    assert "--aclfile" in command or "--requirepass" in command
    acl = command[command.index("--aclfile") + 1]
    assert acl.startswith("/run/secrets/"), "the ACL (with the password) comes from a compose secret"
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--save") + 1] == ""
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "ports" not in redis, "Redis is reachable only on the internal network"
    assert compose()["networks"]["backend"]["internal"] is True


def test_compose_secrets_are_files_and_used_through_file_variables() -> None:
    spec = compose()
    for name, secret in spec["secrets"].items():
        assert secret["file"].startswith("./secrets/"), name
    for service in ("worker", "flower", "orchestrator"):
        env = spec["services"][service]["environment"]
        assert "TOOLCHORD_BROKER_URL" not in env, "the URL holds the password: use the _FILE form"
        assert env["TOOLCHORD_BROKER_URL_FILE"] == "/run/secrets/redis-url"
        assert "redis-url" in spec["services"][service]["secrets"]


def test_compose_matches_the_compose_specification() -> None:
    """Validate against the Compose Specification's JSON schema where check-jsonschema ships it."""
    schemas = pytest.importorskip("check_jsonschema.builtin_schemas")
    jsonschema = pytest.importorskip("jsonschema")
    import importlib.resources
    import json

    schema = json.loads(
        importlib.resources.files(schemas).joinpath("vendor/compose-spec.json").read_text()
    )
    jsonschema.validate(compose(), schema)


# -- Dockerfile ---------------------------------------------------------------------------------


def test_dockerfile_builds_from_python_311_slim_and_installs_the_package() -> None:
    instructions = dockerfile_instructions()
    froms = [args.split()[0] for op, args in instructions if op == "FROM"]
    assert froms and all(image == "python:3.11-slim" for image in froms)
    runs = " ".join(args for op, args in instructions if op == "RUN")
    assert re.search(r"pip install \.(\s|$)", runs)
    assert re.search(r"apt-get install -y --no-install-recommends [^&]*\blibseccomp2\b", runs)
    assert "rm -rf /var/lib/apt/lists/*" in runs
    assert not any(op == "ADD" for op, _ in instructions), "COPY only: ADD can fetch URLs and unpack"


def test_dockerfile_runs_as_a_numeric_non_root_user() -> None:
    users = [args.strip() for op, args in dockerfile_instructions() if op == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0


def test_dockerfile_entrypoint_and_cmd_are_exec_form_and_run_the_worker() -> None:
    instructions = dict((op, args) for op, args in dockerfile_instructions() if op in ("CMD", "ENTRYPOINT"))
    assert yaml.safe_load(instructions["CMD"]) == ["toolchord", "worker"]
    assert yaml.safe_load(instructions["ENTRYPOINT"])[0].endswith("tini")


def test_dockerfile_sets_no_secrets() -> None:
    env = " ".join(args for op, args in dockerfile_instructions() if op in ("ENV", "ARG"))
    assert not re.search(r"(PASSWORD|_URL=|BASIC_AUTH)", env)


def test_dockerignore_keeps_secrets_and_vcs_out_of_the_context() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", "secrets", ".env", "tests"} <= ignored
    assert "README.md" not in ignored, "pyproject.toml's readme is needed by pip install ."


# -- Kubernetes ---------------------------------------------------------------------------------


def test_k8s_manifests_are_valid_yaml_with_kind_and_name() -> None:
    docs = k8s_documents()
    assert docs
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        if doc["kind"] != "Kustomization":
            assert doc["metadata"]["name"]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "ScaledObject", "TriggerAuthentication"} <= kinds


def test_k8s_kustomization_lists_every_manifest_but_the_secret_example() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    expected = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert set(kustomization["resources"]) == expected


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_k8s_kustomize_build_succeeds() -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=False
    )
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    assert all(d["metadata"].get("namespace") == "toolchord" for d in docs if d["kind"] != "Namespace")
    # The Redis NetworkPolicy admits pods by the part-of label: the pod templates must carry it.
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            assert doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "toolchord"


def test_k8s_worker_deployment_has_resources_and_probes() -> None:
    worker = next(spec for name, spec in pod_specs() if name == "toolchord-worker")
    container = worker["containers"][0]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        assert "inspect ping" in " ".join(command)
    assert worker["terminationGracePeriodSeconds"] > 300, "warm shutdown needs time for running calls"


def test_k8s_keda_scaler_watches_the_default_queue_list() -> None:
    docs = k8s_documents()
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert scaled["spec"]["scaleTargetRef"]["name"] in deployments
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "redis"
    assert trigger["metadata"]["listName"] == DEFAULT_QUEUE
    assert int(trigger["metadata"]["listLength"]) > 0
    auth = next(d for d in docs if d["kind"] == "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]} == {"username", "password"}
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert config["data"]["TOOLCHORD_DEFAULT_QUEUE"] == DEFAULT_QUEUE


def test_k8s_default_queue_matches_the_worker_and_the_settings() -> None:
    from toolchord.worker.config import Settings

    assert Settings().default_queue == DEFAULT_QUEUE
    worker = next(spec for name, spec in pod_specs() if name == "toolchord-worker")
    args = worker["containers"][0]["args"]
    assert args[args.index("-Q") + 1] == DEFAULT_QUEUE


def secret_keys_referenced(node: Any) -> set[str]:
    """Keys of toolchord-secrets used by volumes, env secretKeyRefs and KEDA's secretTargetRefs."""
    found: set[str] = set()
    if isinstance(node, dict):
        if node.get("secretName") == "toolchord-secrets":
            found |= {item["key"] for item in node.get("items", [])}
        if node.get("name") == "toolchord-secrets" and "key" in node:
            found.add(node["key"])
        for value in node.values():
            found |= secret_keys_referenced(value)
    elif isinstance(node, list):
        for value in node:
            found |= secret_keys_referenced(value)
    return found


def test_k8s_secret_keys_referenced_exist_in_the_example_secret() -> None:
    example = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    referenced = secret_keys_referenced(k8s_documents())
    assert {"redis-url", "redis-username", "redis-password", "flower-basic-auth"} <= referenced
    assert referenced <= set(example["stringData"])


def test_k8s_flower_is_cluster_internal() -> None:
    service = next(d for d in k8s_documents() if d["kind"] == "Service" and "flower" in d["metadata"]["name"])
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"


# -- systemd ------------------------------------------------------------------------------------


def test_systemd_unit_parses_and_is_hardened() -> None:
    service = unit()["Service"]
    assert service["User"] and service["User"] != "root"
    assert service["EnvironmentFile"].startswith("/etc/toolchord/")
    for option, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "PrivateDevices": "yes",
        "CapabilityBoundingSet": "",
        "KillMode": "mixed",
    }.items():
        assert service[option] == value, option
    assert "TOOLCHORD_BROKER_URL_FILE=%d/" in service["Environment"], "the URL is a credential file"
    assert int(service["TimeoutStopSec"]) > 300


def test_systemd_unit_allows_the_namespaces_the_sandbox_needs() -> None:
    # user: an unprivileged call's own; mnt: the disk layer; net: netns; pid: the zygote's and
    # each call's; ipc: a call's own IPC namespace. Anything else stays forbidden.
    allowed = set(unit()["Service"]["RestrictNamespaces"].split())
    assert allowed == {"user", "mnt", "net", "pid", "ipc"}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` checks every directive; it needs ExecStart's binary to exist, so the
    copy points it at the installed `toolchord` script (or /bin/true where it is not on PATH)."""
    binary = shutil.which("toolchord") or "/bin/true"
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace("/opt/toolchord/bin/toolchord", binary))
    verified = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )
    assert verified.returncode == 0, verified.stderr
    assert "Unknown key" not in verified.stderr and "Unknown section" not in verified.stderr


def test_systemd_execstart_escapes_the_celery_hostname_placeholder() -> None:
    argv = shlex.split(unit()["Service"]["ExecStart"])
    hostname = argv[argv.index("--hostname") + 1]
    assert hostname == "toolchord@%%h", "systemd would expand a bare %h itself"
