"""Secure defaults that can be checked without running a cluster.

- no pickle in any serializer/accept_content setting anywhere in the repo's code and config;
- Flower never configured unauthenticated on a non-loopback address;
- containers non-root, read-only, no-new-privileges, all capabilities dropped;
- every TOOLCHORD_*/FLOWER_* variable the deployment uses is documented;
- the generated secrets are consistent and the Redis ACL really locks Redis down.
"""

from __future__ import annotations

import ast
import re
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SERIALIZER_KEYS = re.compile(
    r"(accept_content|result_accept_content|serializer|CELERY_ACCEPT_CONTENT|CELERY_\w*SERIALIZER)", re.I
)
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def repo_files(*suffixes: str) -> Iterator[Path]:
    skip = {".git", "tests", "node_modules", ".venv", "build", "dist"}
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not (set(rel.parts) & skip) and not rel.parts[0].endswith(".egg-info"):
            if path.suffix in suffixes or path.name in suffixes:
                yield path


def deployment_files() -> list[Path]:
    files = [ROOT / "docker-compose.yml", ROOT / "Dockerfile"]
    files += [p for p in (ROOT / "deploy").rglob("*") if p.is_file()]
    return files


def _mentions_pickle(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "pickle" in n.value.lower()
               for n in ast.walk(node))


def python_serializer_settings(path: Path) -> Iterator[tuple[int, str, ast.AST]]:
    """(line, name, value) of keyword arguments, dict entries and assignments named like a
    Celery/kombu serializer setting."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg and SERIALIZER_KEYS.fullmatch(node.arg):
            yield node.value.lineno, node.arg, node.value
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and SERIALIZER_KEYS.fullmatch(key.value):
                    yield key.lineno, key.value, value
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if name and SERIALIZER_KEYS.fullmatch(name):
                    yield node.lineno, name, node.value


def test_no_pickle_in_python_serializer_settings() -> None:
    settings = [(p, line, name) for p in repo_files(".py") for line, name, value in python_serializer_settings(p)
                if _mentions_pickle(value)]
    assert not settings, f"pickle configured: {settings}"


def test_the_celery_apps_accept_json_only() -> None:
    from toolchord.worker.celery_app import create_app
    from toolchord.worker.config import Settings

    distributed = create_app(Settings.from_env({"TOOLCHORD_BROKER_URL": "redis://127.0.0.1:1/0"}))
    embedded = create_app(Settings.from_env({}))
    for app in (distributed, embedded):
        assert list(app.conf.accept_content) == ["json"]
        assert list(app.conf.result_accept_content or ["json"]) == ["json"]
        assert app.conf.task_serializer == app.conf.result_serializer == "json"


def test_no_pickle_in_config_files() -> None:
    pattern = re.compile(r"(accept|serializ)\w*\s*[:=].*pickle", re.I)
    files = list(repo_files(".yml", ".yaml", ".toml", ".cfg", ".ini", ".env", ".service", ".conf", "Dockerfile", ".example"))
    assert files
    offenders = [f"{p}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders


def test_deployment_never_opens_flowers_unauthenticated_api() -> None:
    for path in deployment_files():
        text = path.read_text()
        assert not re.search(r"FLOWER_UNAUTHENTICATED_API\s*[:=]\s*['\"]?(1|true|yes)", text, re.I), path
        assert "--unauthenticated" not in text


def _flower_has_auth(command: str, env: dict[str, Any]) -> bool:
    return "FLOWER_BASIC_AUTH" in env or "FLOWER_BASIC_AUTH=" in command or "--basic-auth" in command or "FLOWER_OAUTH2" in command


def test_compose_flower_is_authenticated_and_published_on_loopback_only() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    flowers = {n: s for n, s in services.items() if "flower" in " ".join(map(str, s.get("command", [])))}
    assert flowers
    for name, service in flowers.items():
        assert _flower_has_auth(" ".join(service["command"]), service.get("environment", {})), name
        for port in service.get("ports", []):
            assert str(port).split(":")[0] in LOOPBACK, f"{name} publishes {port} beyond loopback"


def test_k8s_flower_is_authenticated_from_a_secret() -> None:
    found = 0
    for path in (ROOT / "deploy" / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] != "Deployment":
                continue
            for container in doc["spec"]["template"]["spec"]["containers"]:
                args = container.get("args", [])
                if "flower" not in args:
                    continue
                found += 1
                address = args[args.index("--address") + 1] if "--address" in args else "127.0.0.1"
                env = {e["name"]: e for e in container.get("env", [])}
                if address not in LOOPBACK:
                    assert "FLOWER_BASIC_AUTH" in env, path
                    assert "secretKeyRef" in env["FLOWER_BASIC_AUTH"]["valueFrom"], "credentials come from a Secret"
    assert found


def test_compose_containers_are_locked_down() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name, service in services.items():
        assert str(service.get("user", "0")).split(":")[0] not in ("0", "root"), f"{name} runs as root"
        assert service.get("read_only") is True, name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert service.get("cap_drop") == ["ALL"], name
        assert not service.get("cap_add"), f"{name}: a non-root container needs no capabilities"
        assert not service.get("privileged"), name
        assert service.get("network_mode") != "host", name


def test_k8s_pods_are_locked_down() -> None:
    for path in (ROOT / "deploy" / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            pod = doc["spec"]["template"]["spec"]
            name = doc["metadata"]["name"]
            assert pod["securityContext"]["runAsNonRoot"] is True, name
            assert pod["securityContext"]["runAsUser"] != 0, name
            assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
            assert pod.get("automountServiceAccountToken") is False, name
            assert not (pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC")), name
            for container in pod["containers"]:
                context = container["securityContext"]
                assert context["allowPrivilegeEscalation"] is False, name
                assert context["readOnlyRootFilesystem"] is True, name
                assert context["capabilities"]["drop"] == ["ALL"], name
                assert not context["capabilities"].get("add"), name
                assert not context.get("privileged"), name
                assert container["resources"]["limits"]["memory"], name


def test_every_deployment_refuses_direct_forks_of_the_worker() -> None:
    """A tool the sandbox zygote cannot import must fail, not run with the worker's secrets."""
    setting = "TOOLCHORD_SANDBOX_DIRECT_FORK"
    compose_env = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["x-toolchord-env"]
    assert compose_env[setting] == "refuse"
    configmap = yaml.safe_load((ROOT / "deploy" / "k8s" / "configmap.yaml").read_text())
    assert configmap["data"][setting] == "refuse"
    assert f"{setting}=refuse" in (ROOT / "Dockerfile").read_text()
    env_file = (ROOT / "deploy" / "systemd" / "worker.env.example").read_text().splitlines()
    assert f"{setting}=refuse" in env_file


def test_every_variable_the_deployment_uses_is_documented() -> None:
    documented = (ROOT / "docs" / "configuration.md").read_text()
    used: set[str] = set()
    for path in deployment_files():
        used |= set(re.findall(r"\b((?:TOOLCHORD|FLOWER)_[A-Z0-9_]*[A-Z0-9])\b", path.read_text()))
    assert used
    missing = sorted(v for v in used if f"`{v}`" not in documented)
    assert not missing, f"not in docs/configuration.md: {missing}"


def test_every_variable_the_code_reads_is_documented() -> None:
    documented = (ROOT / "docs" / "configuration.md").read_text()
    source = "\n".join(p.read_text() for p in repo_files(".py"))
    read = set(re.findall(r"[\"']((?:TOOLCHORD)_[A-Z0-9_]*[A-Z0-9])[\"']", source))
    assert "TOOLCHORD_BROKER_URL" in read
    missing = sorted(v for v in read if f"`{v}`" not in documented)
    assert not missing, f"not in docs/configuration.md: {missing}"


# -- generated secrets and the Redis ACL ---------------------------------------------------------


def make_secrets(directory: Path, host: str = "redis") -> dict[str, str]:
    subprocess.run(["sh", str(ROOT / "deploy" / "make-secrets.sh"), str(directory), host],
                   check=True, capture_output=True, timeout=30)
    return {p.name: p.read_text() for p in directory.iterdir()}


def test_make_secrets_writes_consistent_private_secrets(tmp_path: Path) -> None:
    directory = tmp_path / "secrets"
    first = make_secrets(directory)
    assert set(first) == {"redis-username", "redis-password", "redis-users.acl", "redis-url", "flower-basic-auth"}
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    url = urlparse(first["redis-url"])
    assert (url.username, url.password, url.hostname) == (first["redis-username"], first["redis-password"], "redis")
    assert len(first["redis-password"]) >= 32
    assert "user default off" in first["redis-users.acl"]
    assert f">{first['redis-password']} " in first["redis-users.acl"]
    user, password = first["flower-basic-auth"].split(":")
    assert user and len(password) >= 32
    assert make_secrets(directory) == first, "re-running must keep existing passwords"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A private redis-server started with the generated ACL file, as the deployments start it."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    port = _free_port()
    secrets = make_secrets(tmp_path / "secrets", "127.0.0.1")
    secrets["redis-url"] = secrets["redis-url"].replace(":6379/", f":{port}/")
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--aclfile", str(tmp_path / "secrets" / "redis-users.acl"),
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        secrets["port"] = str(port)
        yield secrets
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_redis_acl_refuses_anonymous_and_admin_commands(acl_redis: dict[str, str]) -> None:
    import redis

    anonymous = redis.Redis(port=int(acl_redis["port"]))
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    client = redis.Redis.from_url(acl_redis["redis-url"])
    assert client.ping()
    for command in (("FLUSHALL",), ("CONFIG", "GET", "dir"), ("KEYS", "*"), ("ACL", "LIST")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)


@pytest.mark.slow
def test_redis_acl_allows_what_celery_and_toolchord_use(acl_redis: dict[str, str]) -> None:
    """A chord over the Redis broker and backend, the idempotency claim scripts and a stream append,
    all logged in as the ACL user the deployments use."""
    import redis
    from celery import Celery, chord
    from celery.contrib.testing.worker import start_worker

    from toolchord.worker.idempotency import RedisIdempotencyStore

    url = acl_redis["redis-url"]
    app = Celery("acl-check", broker=url, backend=url, set_as_current=False)
    app.conf.update(accept_content=["json"], task_serializer="json", result_serializer="json",
                    broker_connection_retry_on_startup=False)

    @app.task(name="acl.add")
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="acl.total")
    def total(values: list[int]) -> int:
        return sum(values)

    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        result = chord([add.s(i, i) for i in range(4)], total.s()).apply_async()
        assert result.get(timeout=20) == 12

    client = redis.Redis.from_url(url)
    store = RedisIdempotencyStore(client)
    claim = store.claim("acl-check", "token", 5.0, 60)
    assert claim is not None
    assert store.complete("acl-check", "token", '{"ok": true}', 60) == '{"ok": true}'
    assert client.xadd("toolchord:acl-check", {"event": "{}"})


class _ComposeLoader(yaml.SafeLoader):
    """Compose's merge tags (`!reset`, `!override`) as plain values tagged in a wrapper."""


def _tagged(loader: yaml.SafeLoader, tag: str, node: yaml.Node) -> dict[str, Any]:
    value = loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else (
        loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else loader.construct_scalar(node))
    return {"tag": tag, "value": value}


_ComposeLoader.add_multi_constructor("!", _tagged)


def _hidden(path: str) -> bool:
    from toolchord.worker.sandbox.disk import SECRET_DIRECTORIES

    return any(path.startswith(directory + "/") for directory in SECRET_DIRECTORIES)


def test_worker_secrets_sit_where_a_root_workers_calls_cannot_see_them() -> None:
    """A root worker's calls get a mount namespace that hides these directories."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert _hidden(services["worker"]["environment"]["TOOLCHORD_BROKER_URL_FILE"])
    for path in (ROOT / "deploy" / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"] == "toolchord-worker":
                mounts = doc["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
                secret_mounts = [m for m in mounts if m["name"] == "secrets"]
                assert secret_mounts and all(_hidden(m["mountPath"] + "/") and m["readOnly"] for m in secret_mounts)
    unit = (ROOT / "deploy" / "systemd" / "toolchord-worker.service").read_text()
    # systemd credentials live under /run/credentials; the source file is root's alone.
    assert "LoadCredential=broker-url:/etc/toolchord/broker-url" in unit
    assert "install -m 600 -o root broker-url /etc/toolchord/broker-url" in unit


def test_k8s_secret_files_are_not_readable_by_other_uids() -> None:
    """No "other" permission bits: a per-call uid (no groups) cannot read a mounted secret."""
    found = 0
    for path in (ROOT / "deploy" / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            for volume in doc["spec"]["template"]["spec"].get("volumes", []):
                if "secret" in volume:
                    found += 1
                    assert volume["secret"]["defaultMode"] & 0o007 == 0, (path.name, volume["name"])
    assert found


def test_compose_root_worker_reads_its_secret_from_the_private_directory_only() -> None:
    override = yaml.load((ROOT / "deploy" / "compose" / "uid-drop.override.yml").read_text(), Loader=_ComposeLoader)
    worker = override["services"]["worker"]
    # Nothing under /run/secrets, whose bind-mounted files keep their world-readable host mode ...
    assert worker["secrets"] == {"tag": "reset", "value": []}
    # ... the URL comes from the secrets directory (mode 0700, see make-secrets.sh) mounted read-only.
    target = next(v.split(":")[1] for v in worker["volumes"] if v.startswith("./secrets:"))
    assert any(v == f"./secrets:{target}:ro" for v in worker["volumes"])
    assert worker["environment"]["TOOLCHORD_BROKER_URL_FILE"] == f"{target}/redis-url"
