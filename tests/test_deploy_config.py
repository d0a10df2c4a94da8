"""The deployment files agree with the code: docker-compose.yml, the Dockerfiles, the nginx
configuration, the Kubernetes manifests and the KServe example name only settings, ports,
paths, flags and scripts that exist. (No Docker or Kubernetes here: these read the files;
tests/test_deploy_nginx.py runs the compose topology itself.)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from attnserve.server.config import DEVICES, ServerConfig, env_name  # noqa: E402

from tests.server_process import REPO_ROOT  # noqa: E402
from tests.setup_script import BUILD_VARIABLES  # noqa: E402
from tests.test_deploy_nginx import NGINX_CONF, UPSTREAM_CONF, UPSTREAM_HTTP_CONF  # noqa: E402

pytestmark = pytest.mark.e2e  # runs the export job and the command's help in subprocesses

DEPLOY = REPO_ROOT / "deploy"
COMPOSE = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
SERVER_SERVICES = ("server", "server-cuda")
REAL_VARIABLES = {env_name(f.name) for f in dataclasses.fields(ServerConfig)}
DEFAULTS = ServerConfig()
K8S_DOCS = [doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]
KSERVE_DOCS = [doc for doc in yaml.safe_load_all((DEPLOY / "kserve" / "inferenceservice.yaml").read_text()) if doc]
COMPILERS = {"gcc", "g++", "cc", "clang", "build-essential", "make", "cmake", "python3-dev", "python3.11-dev"}


# ---------------------------------------------------------------------------------------------
# Reading the files
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]]  # (KEYWORD, arguments), continuation lines joined

    def all(self, keyword: str) -> list[str]:
        return [args for key, args in self.instructions if key == keyword]

    def env(self) -> dict[str, str]:
        values = {}
        for args in self.all("ENV"):
            for token in shlex.split(args):
                name, sep, value = token.partition("=")
                assert sep, f"ENV {args!r}: use NAME=VALUE"
                values[name] = value
        return values

    def copies(self) -> list[tuple[str | None, list[str], str]]:
        """(--from stage or None, sources, destination) of each COPY."""
        result = []
        for args in self.all("COPY"):
            words = args.split()
            source_stage = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
            paths = [w for w in words if not w.startswith("--")]
            result.append((source_stage, paths[:-1], paths[-1]))
        return result

    def exec_form(self, keyword: str) -> list[str]:
        (args,) = self.all(keyword)[-1:] or [""]
        args = re.sub(r"^(--\S+\s+)*CMD\s+", "", args) if keyword == "HEALTHCHECK" else args
        return json.loads(args)


def parse_dockerfile(path: Path) -> dict[str, Stage]:
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                            if not line.lstrip().startswith("#")))
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        keyword, _, rest = line.strip().partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and current is None:
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')
        elif keyword == "FROM":
            base, _, name = re.sub(r"\s+AS\s+", " AS ", rest, flags=re.I).partition(" AS ")
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
            current = stages[name.strip()] = Stage(name.strip(), base.strip(), [])
        else:
            assert current is not None, f"{path}: {keyword} before FROM"
            current.instructions.append((keyword, rest))
    return stages


def stage_chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and every stage it is built FROM or copies --from, transitively."""
    seen: list[Stage] = []
    pending = [name]
    while pending:
        stage = stages[pending.pop()]
        if stage in seen:
            continue
        seen.append(stage)
        pending += [s for s in [stage.base] + [c[0] for c in stage.copies()] if s in stages]
    return seen


def shell_commands(run: str) -> list[list[str]]:
    """The words of each command of a RUN line, split at &&, || and ; outside quotes."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands = [[]]
    for token in lexer:
        if token in ("&&", "||", ";"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [words for words in commands if words]


def pip_installs(stage: Stage) -> list[list[str]]:
    """The arguments of each `pip install` in the stage's RUN lines (options included)."""
    found = []
    for run in stage.all("RUN"):
        for words in shell_commands(run):
            for i in range(len(words) - 1):
                if words[i].endswith("pip") and words[i + 1] == "install":
                    found.append(words[i + 2:])
    return found


def apt_installs(stage: Stage) -> set[str]:
    packages = set()
    for run in stage.all("RUN"):
        for words in shell_commands(run):
            if words[:2] == ["apt-get", "install"]:
                packages |= {w for w in words[2:] if not w.startswith("-")}
    return packages


def dockerignored(relative: str) -> bool:
    patterns = [p.strip() for p in (REPO_ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "negations are not understood by this test"
    parts = Path(relative).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(c, p.lstrip("/")) or fnmatch.fnmatch(c, p.lstrip("/").replace("**/", ""))
               for c in candidates for p in patterns)


def env_list(container: dict) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", [])}


def compose_env(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in (SERVICES[service].get("environment") or {}).items()}


def setting(env: dict[str, str], field: str):
    """What the server makes of env (as ServerConfig would), else the default."""
    from attnserve.server.config import load_config

    return getattr(load_config([], {k: v for k, v in env.items() if k.startswith("ATTNSERVE_")}), field)


def volume(spec: str) -> tuple[str, str, bool]:
    source, target, *mode = spec.split(":")
    return source, target, "ro" in mode


DOCKERFILES = {"deploy/Dockerfile": parse_dockerfile(DEPLOY / "Dockerfile"),
               "deploy/Dockerfile.cuda": parse_dockerfile(DEPLOY / "Dockerfile.cuda")}


def built_stage(service: str) -> Stage:
    build = SERVICES[service]["build"]
    assert build["context"] == ".", "the Dockerfiles COPY paths relative to the repository root"
    stages = DOCKERFILES[build["dockerfile"]]
    return stages[build.get("target") or list(stages)[-1]]


def all_variables_named() -> dict[str, set[str]]:
    """Every ATTNSERVE_* name each deployment file mentions, anywhere in its text."""
    files = [REPO_ROOT / "docker-compose.yml", DEPLOY / "export-models.sh", DEPLOY / "healthcheck.py",
             *DEPLOY.glob("Dockerfile*"), *DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.conf")]
    return {str(f.relative_to(REPO_ROOT)): set(re.findall(r"ATTNSERVE_[A-Z0-9_]+", f.read_text())) for f in files}


# ---------------------------------------------------------------------------------------------
# Settings and ports
# ---------------------------------------------------------------------------------------------


def test_every_attnserve_variable_named_anywhere_is_a_server_setting():
    named = all_variables_named()
    assert any(named.values())
    for path, names in named.items():
        names -= BUILD_VARIABLES  # setup.py's, read by `pip install .` in a build stage
        assert names <= REAL_VARIABLES, (
            f"{path} names settings the server does not read: {sorted(names - REAL_VARIABLES)}")


def test_every_value_given_to_the_server_is_one_it_accepts():
    from attnserve.server.config import load_config

    envs = {f"compose {s}": compose_env(s) for s in SERVER_SERVICES}
    for path, stages in DOCKERFILES.items():
        envs[f"{path} serve"] = stages["serve"].env()
    envs["k8s"] = env_list(_deployment_container())
    envs["kserve"] = env_list(_kserve_container())
    for where, env in envs.items():
        try:
            load_config([], {k: v for k, v in env.items() if k.startswith("ATTNSERVE_")})
        except SystemExit:
            pytest.fail(f"{where}: the server refuses these settings: {env}")
    assert compose_env("server-cuda")["ATTNSERVE_DEVICE"] == "cuda" in DEVICES


def test_ports_are_the_servers():
    assert (DEFAULTS.http_port, DEFAULTS.port, DEFAULTS.metrics_port) == (8000, 8001, 8002)
    for path, stages in DOCKERFILES.items():
        env = stages["serve"].env()
        exposed = {int(p) for args in stages["serve"].all("EXPOSE") for p in args.split()}
        assert exposed == {setting(env, "http_port"), setting(env, "port"), setting(env, "metrics_port")} == \
            {8000, 8001, 8002}, path
    for service in SERVER_SERVICES:
        env = {**built_stage(service).env(), **compose_env(service)}
        port, metrics_port = setting(env, "port"), setting(env, "metrics_port")
        published = [str(p).rsplit(":", 1)[-1] for p in SERVICES[service].get("ports", [])]
        assert published == [str(metrics_port), str(setting(env, "http_port"))], \
            f"{service} publishes its metrics and REST ports (on loopback), not gRPC's"
        assert upstream_port() == port, "nginx must reach the replicas on their gRPC port"
        assert upstream_port(UPSTREAM_HTTP_CONF) == setting(env, "http_port"), "and on their REST port"


def upstream_port(path: Path = UPSTREAM_CONF) -> int:
    (line,) = [text for text in path.read_text().splitlines() if re.match(r"\s*server\s", text)]
    return int(re.match(r"\s*server\s+[^\s:]+:(\d+)", line).group(1))


# ---------------------------------------------------------------------------------------------
# docker-compose.yml
# ---------------------------------------------------------------------------------------------


def test_compose_start_order_and_replicas():
    server = SERVICES["server"]
    assert server["deploy"]["replicas"] == 2
    for service in SERVER_SERVICES:
        assert SERVICES[service]["depends_on"]["export"]["condition"] == "service_completed_successfully"
    nginx = SERVICES["nginx"]["depends_on"]
    assert nginx["server"]["condition"] == "service_healthy"
    assert nginx["server-cuda"] == {"condition": "service_healthy", "required": False}
    assert SERVICES["export"].get("restart") == "no"


def test_compose_model_repository_is_one_volume_written_by_export_and_read_only_for_servers():
    (export_volume,) = SERVICES["export"]["volumes"]
    source, target, read_only = volume(export_volume)
    assert source in COMPOSE["volumes"] and not read_only
    export_env = {**DOCKERFILES["deploy/Dockerfile"]["export"].env(), **compose_env("export")}
    assert export_env["ATTNSERVE_MODEL_REPOSITORY"] == target
    for service in SERVER_SERVICES:
        (server_volume,) = SERVICES[service]["volumes"]
        assert volume(server_volume) == (source, str(setting({**built_stage(service).env(), **compose_env(service)},
                                                             "model_repository")), True), service


def test_compose_health_checks_run_the_repository_script_copied_into_the_image():
    for service in SERVER_SERVICES:
        stage = built_stage(service)
        destination = _copied_to(stage, "deploy/healthcheck.py")
        assert SERVICES[service]["healthcheck"]["test"] == ["CMD", "python", destination]
        assert stage.exec_form("HEALTHCHECK") == ["python", destination]
    nginx_check = SERVICES["nginx"]["healthcheck"]["test"]
    assert nginx_check[:2] == ["CMD", "wget"] and nginx_check[-1].endswith(":8081/healthz")
    assert re.search(r"^\s*listen 8081;", NGINX_CONF.read_text(), re.M)
    assert re.search(r"location = /healthz", NGINX_CONF.read_text())


def test_compose_cuda_profile_reserves_a_gpu():
    cuda = SERVICES["server-cuda"]
    assert cuda["profiles"] == ["cuda"] and "profiles" not in SERVICES["server"]
    assert cuda["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
    (device,) = cuda["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert compose_env("server-cuda")["ATTNSERVE_DEVICE"] == "cuda"


def test_compose_nginx_mounts_the_config_the_nginx_test_runs():
    nginx = SERVICES["nginx"]
    command = nginx["command"]
    conf_path = command[command.index("-c") + 1]
    mounts = {volume(v)[1]: volume(v) for v in nginx["volumes"]}
    source, _, read_only = mounts[conf_path]
    assert (REPO_ROOT / source).resolve() == NGINX_CONF and read_only
    # nginx resolves `include upstream.conf;` against the directory of the -c file; each upstream
    # block includes its own file.
    for upstream, path in (("attnserve", UPSTREAM_CONF), ("attnserve_http", UPSTREAM_HTTP_CONF)):
        assert re.search(rf"upstream {upstream} \{{[^}}]*include {path.name};", NGINX_CONF.read_text()), upstream
        source, _, read_only = mounts[str(Path(conf_path).parent / path.name)]
        assert (REPO_ROOT / source).resolve() == path and read_only
    assert command[-2:] == ["-g", "daemon off;"] and command[command.index("-p") + 1] == "/var/cache/nginx/"
    assert nginx["ports"] == ["8001:8001", "8000:8000"]
    assert re.search(r"^\s*listen 8001 http2;", NGINX_CONF.read_text(), re.M)
    assert re.search(r"^\s*listen 8000;", NGINX_CONF.read_text(), re.M)


@pytest.mark.parametrize("path", [UPSTREAM_CONF, UPSTREAM_HTTP_CONF], ids=lambda p: p.name)
def test_compose_nginx_finds_every_replica_by_dns(path):
    conf = path.read_text()
    name = re.search(r"^\s*server\s+([^\s:]+):\d+\s+resolve\b", conf, re.M).group(1)
    assert re.search(r"^\s*resolver 127\.0\.0\.11\b", conf, re.M), "Docker's embedded DNS"
    for service in SERVER_SERVICES:
        assert name in SERVICES[service]["networks"]["default"]["aliases"], service
    # `resolve` and `resolver` in an upstream block came to open-source nginx in 1.27.3; they need a zone.
    version = tuple(int(x) for x in re.match(r"nginx:(\d+)\.(\d+)", SERVICES["nginx"]["image"]).groups())
    assert version >= (1, 28)
    assert re.search(r"upstream attnserve \{[^}]*zone attnserve", NGINX_CONF.read_text())
    assert re.search(r"upstream attnserve_http \{[^}]*zone attnserve_http", NGINX_CONF.read_text())


def test_nginx_conf_carries_grpc_of_the_servers_size_and_fails_over():
    conf = NGINX_CONF.read_text()
    directive = lambda name: re.search(rf"^\s*{name}\s+([^;]+);", conf, re.M).group(1)  # noqa: E731
    assert directive("grpc_pass") == "grpc://attnserve"
    size = directive("client_max_body_size")
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    number, unit = re.fullmatch(r"(\d+)([kmg]?)", size.lower()).groups()
    assert number == "0" or int(number) * units[unit] > DEFAULTS.max_message_bytes, size
    assert {"error", "timeout"} <= set(directive("grpc_next_upstream").split())
    for name in ("grpc_connect_timeout", "grpc_read_timeout", "grpc_send_timeout"):
        assert directive(name)


def test_nginx_conf_balances_rest_with_keepalive_and_retries_503():
    """The REST server block: to the replicas' REST port over kept-alive HTTP/1.1, bodies up to
    the replicas' own limit, and a 503 (never computed, server/errors.py) sent to the next replica
    (tests/test_deploy_nginx.py shows each of these working, or failing without it)."""
    rest = re.search(r"\n    server \{\n        # The REST port.*?\n    \}\n", NGINX_CONF.read_text(), re.S).group(0)
    directive = lambda name: re.search(rf"^\s*{name}\s+([^;]+);", rest, re.M).group(1)  # noqa: E731
    assert directive("listen") == "8000"
    assert directive("proxy_pass") == "http://attnserve_http"
    assert directive("proxy_http_version") == "1.1" and directive("proxy_set_header Connection") == '""'
    assert set(directive("proxy_next_upstream").split()) == {"error", "timeout", "non_idempotent"}
    infer = re.search(r"location ~ \^/v2/models/.*?/infer\$ \{(.*?)\}", rest, re.S).group(1)
    assert "proxy_pass http://attnserve_http;" in infer
    assert re.search(r"proxy_next_upstream error timeout http_503 non_idempotent;", infer)
    assert directive("client_max_body_size") == "64m"
    assert int(compose_env("server")["ATTNSERVE_MAX_MESSAGE_BYTES"]) == 64 << 20
    assert re.search(r"upstream attnserve_http \{[^}]*keepalive \d+;", NGINX_CONF.read_text())
    (line,) = [text for text in UPSTREAM_HTTP_CONF.read_text().splitlines() if re.match(r"\s*server\s", text)]
    (grpc_line,) = [text for text in UPSTREAM_CONF.read_text().splitlines() if re.match(r"\s*server\s", text)]
    assert line.split()[2:] == grpc_line.split()[2:], "the same failure accounting for both ports"


# ---------------------------------------------------------------------------------------------
# Dockerfiles
# ---------------------------------------------------------------------------------------------


def _copied_to(stage: Stage, source: str) -> str:
    (destination,) = [d for frm, sources, d in stage.copies() if frm is None and source in sources]
    return destination


@pytest.mark.parametrize("path", sorted(DOCKERFILES))
def test_copy_sources_exist_and_are_in_the_build_context(path):
    for stage in DOCKERFILES[path].values():
        for source_stage, sources, _ in stage.copies():
            if source_stage is not None:
                assert source_stage in DOCKERFILES[path], f"{path}: COPY --from={source_stage}"
                continue
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"{path}: COPY {source}: no such file in the repository"
                assert not dockerignored(source), f"{path}: COPY {source}, but .dockerignore leaves it out"


@pytest.mark.parametrize("path", sorted(DOCKERFILES))
def test_serving_image_has_no_torch_no_compilers_and_a_non_root_user(path):
    stages = DOCKERFILES[path]
    serve = stages["serve"]
    assert list(stages)[-1] == "serve", "a plain `docker build` should give the serving image"
    installs = [args for stage in stage_chain(stages, "serve") for args in pip_installs(stage)]
    assert ["."] in installs, "the serving image installs the base package"
    for args in installs:
        assert not any("torch" in a or "[" in a for a in args), f"{path}: serving image installs {args}"
    (user,) = serve.all("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root uid (Kubernetes runAsNonRoot can verify it)"
    assert not apt_installs(serve) & COMPILERS
    assert serve.exec_form("ENTRYPOINT") == ["attnserve", "serve"]
    env = serve.env()
    repository = env["ATTNSERVE_MODEL_REPOSITORY"]
    assert any(f"mkdir -p {repository}" in run and f"chown {uid}" in run for run in serve.all("RUN"))


@pytest.mark.parametrize("path", sorted(DOCKERFILES))
def test_serving_image_builds_the_native_plane_and_ships_only_its_run_time_libraries(path):
    """Both serving images: `make native`'s build dependencies in the build stage, the extension
    required there (ATTNSERVE_NATIVE_BUILD=on), and in the serving stage only run-time libraries,
    with a build step that loads the extension (tests/containers/ runs it). deploy/Dockerfile names
    Debian 12's packages; deploy/Dockerfile.cuda reads them off its build stage (their names differ
    between Ubuntu 24.04 and the Debian stand-in CI builds it on)."""
    stages = DOCKERFILES[path]
    build, serve = stages["build"], stages["serve"]
    native_debs = re.search(r"^NATIVE_DEBS := (.*)$", (REPO_ROOT / "Makefile").read_text(), re.M).group(1).split()
    assert set(native_debs) <= apt_installs(build), native_debs
    assert _copied_to(build, "setup.py") and _copied_to(build, "native")
    assert any(words[:3] == ["ATTNSERVE_NATIVE_BUILD=on", "/opt/venv/bin/pip", "install"]
               for run in build.all("RUN") for words in shell_commands(run))
    runtime = apt_installs(serve)
    assert not {p for p in runtime if p.endswith("-dev")} and not runtime & COMPILERS
    if path == "deploy/Dockerfile":
        assert "libgrpc++1.51" in runtime
        assert any("ATTNSERVE_NATIVE_BUILD=off" in run for run in stages["export-build"].all("RUN"))
    else:
        assert any("dpkg -S" in run and "> /opt/native-runtime-packages" in run for run in build.all("RUN"))
        assert any(src == "build" and "/opt/native-runtime-packages" in sources for src, sources, _ in serve.copies())
        assert "/tmp/native-runtime-packages" in runtime  # installed from the file the build stage wrote
    assert any("why_unavailable()" in run for run in serve.all("RUN"))


def test_export_image_pins_the_projects_torch_from_the_cpu_index():
    stages = DOCKERFILES["deploy/Dockerfile"]
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    (torch_pin,) = [r for r in pyproject["project"]["optional-dependencies"]["export"] if r.startswith("torch")]
    chain = stage_chain(stages, "export")
    build = next(s for s in chain if any("torch==${TORCH_VERSION}" in a for args in pip_installs(s) for a in args))
    args = dict(a.split("=", 1) for a in build.all("ARG"))
    assert f"torch=={args['TORCH_VERSION']}" == torch_pin
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert any(".[export]" in a for s in chain for args in pip_installs(s) for a in args)
    export = stages["export"]
    assert export.exec_form("ENTRYPOINT") == ["sh", _copied_to(export, "deploy/export-models.sh")]
    assert export.all("USER") == stages["serve"].all("USER")


def test_cuda_image_swaps_onnxruntime_for_onnxruntime_gpu_on_a_cuda_runtime():
    stages = DOCKERFILES["deploy/Dockerfile.cuda"]
    # Ubuntu 24.04: gRPC C++ 1.51, what the native plane builds with (22.04 has 1.30).
    assert re.fullmatch(r"nvidia/cuda:12\.[\d.]+-cudnn-runtime-ubuntu24\.04", stages["serve"].base)
    assert stages["build"].base == stages["serve"].base
    runs = " ".join(stages["build"].all("RUN"))
    assert "pip uninstall -y onnxruntime" in runs
    assert any(a.startswith("${ONNXRUNTIME_GPU}") for args in pip_installs(stages["build"]) for a in args)
    assert "python3" in apt_installs(stages["serve"])
    assert stages["serve"].env()["ATTNSERVE_DEVICE"] == "cuda"


# ---------------------------------------------------------------------------------------------
# The export job
# ---------------------------------------------------------------------------------------------


def test_export_job_flags_exist():
    help_text = subprocess.run([sys.executable, "-m", "attnserve", "export", "--help"], cwd=REPO_ROOT,
                               capture_output=True,
                               text=True, check=True).stdout
    script = (DEPLOY / "export-models.sh").read_text()
    calls = re.findall(r"\" export (.*)", script)
    assert calls
    for call in calls:
        for flag in re.findall(r"--[a-z][a-z-]*", call):
            assert re.search(rf"\s{flag}\b", help_text), f"attnserve export has no {flag}"
    presets = re.search(r"--preset \{([^}]*)\}", help_text).group(1).split(",")
    default = re.search(r'EXPORT_PRESETS:-([^}"]*)', script).group(1).split()
    assert set(default) == set(presets)


def _run_export_job(repository: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """deploy/export-models.sh with a command that records `attnserve export` calls instead of
    exporting (minutes of torch); everything else runs for real."""
    calls = tmp_path / "calls"
    fake = tmp_path / "attnserve"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "export" ]; then shift; echo "$*" >> {calls}; exit 0; fi\nexit 64\n')
    fake.chmod(0o755)
    result = subprocess.run(["sh", str(DEPLOY / "export-models.sh")], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "ATTNSERVE": str(fake),
                                             "ATTNSERVE_MODEL_REPOSITORY": str(repository)})
    recorded = [line.split() for line in calls.read_text().splitlines()] if calls.exists() else []
    return result, recorded


def test_export_job_skips_models_that_have_a_version(model_repository, tmp_path):
    before = sorted(p.relative_to(model_repository) for p in model_repository.rglob("*"))
    result, calls = _run_export_job(model_repository, tmp_path)
    assert result.returncode == 0, result.stderr
    assert calls == [] and result.stdout.count("not exporting") == 2, result.stdout
    assert sorted(p.relative_to(model_repository) for p in model_repository.rglob("*")) == before


def test_export_job_exports_what_is_missing(model_repository, tmp_path):
    repository = tmp_path / "models"
    # self_attention complete, cross_attention only begun (no version directory: nothing to serve)
    import shutil

    shutil.copytree(model_repository / "self_attention", repository / "self_attention")
    (repository / "cross_attention" / ".export-1-tmp").mkdir(parents=True)
    result, calls = _run_export_job(repository, tmp_path)
    assert result.returncode == 0, result.stderr
    assert calls == [["--preset", "cross_attention", "--repository", str(repository)]], result.stdout


# ---------------------------------------------------------------------------------------------
# Kubernetes and KServe
# ---------------------------------------------------------------------------------------------


def _kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _deployment_container() -> dict:
    (deployment,) = _kind(K8S_DOCS, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _kserve_container() -> dict:
    (isvc,) = _kind(KSERVE_DOCS, "InferenceService")
    (container,) = isvc["spec"]["predictor"]["containers"]
    return container


def _mount_path(container: dict, volume_name: str) -> dict:
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume_name]
    return mount


def _assert_grpc_probes(container: dict, port: int, names=("startupProbe", "readinessProbe", "livenessProbe")):
    for probe in names:
        assert container[probe]["grpc"] == {"port": port}, f"{probe}: the grpc.health.v1 service on {port}"


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert {i["name"] for i in kustomization["images"]} == {"attnserve", "attnserve-export"}


def test_k8s_deployment_uses_the_servers_port_probes_and_repository():
    (deployment,) = _kind(K8S_DOCS, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _deployment_container()
    env = env_list(container)
    port, metrics_port, http_port = setting(env, "port"), setting(env, "metrics_port"), setting(env, "http_port")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": http_port, "grpc": port, "metrics": metrics_port} == \
        {"http": 8000, "grpc": 8001, "metrics": 8002}
    _assert_grpc_probes(container, port, names=("startupProbe", "livenessProbe"))
    # Readiness on the REST port, the path that answers 503 from SIGTERM on (tests/test_rest_drain.py).
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": http_port}
    mount = _mount_path(container, "models")
    assert mount["mountPath"] == str(setting(env, "model_repository")) and mount["readOnly"] is True
    (init,) = pod["initContainers"]
    assert init["image"] == SERVICES["export"]["image"] and container["image"] == SERVICES["server"]["image"]
    assert _mount_path(init, "models")["mountPath"] == env_list(init)["ATTNSERVE_MODEL_REPOSITORY"]
    assert "models" in {v["name"] for v in pod["volumes"]}
    uid = int(DOCKERFILES["deploy/Dockerfile"]["serve"].all("USER")[0].split(":")[0])
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == uid
    assert "lifecycle" not in container, "the server's own drain delay replaces a preStop sleep"
    assert pod["terminationGracePeriodSeconds"] > setting(env, "drain_delay_s") + setting(env, "grace_period_s")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics_port)
    assert container["resources"]["requests"]["cpu"], "the HPA's utilisation needs a CPU request"
    assert int(env["ATTNSERVE_INTRA_OP_THREADS"]) == int(container["resources"]["requests"]["cpu"])


def test_k8s_services_hpa_and_pdb_select_the_deployment():
    (deployment,) = _kind(K8S_DOCS, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in _deployment_container()["ports"]}
    services = _kind(K8S_DOCS, "Service")
    assert len(services) == 2 and any(s["spec"].get("clusterIP") == "None" for s in services)
    for service in services:
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names
            if port["name"] == "grpc":
                assert port["port"] == 8001 and port["appProtocol"] == "kubernetes.io/h2c"
    (hpa,) = _kind(K8S_DOCS, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (pdb,) = _kind(K8S_DOCS, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_kserve_example_uses_the_servers_port_probes_and_repository():
    (isvc,) = _kind(KSERVE_DOCS, "InferenceService")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    container = _kserve_container()
    assert container["name"] == "kserve-container"
    env = env_list(container)
    # KServe (RawDeployment) sends the Service's port 80, the InferenceService's URL, to the first
    # container port: REST; a port named h2c (or grpc) is marked HTTP/2 for gRPC.
    assert container["ports"] == [
        {"name": "http1", "containerPort": setting(env, "http_port"), "protocol": "TCP"},
        {"name": "h2c", "containerPort": setting(env, "port"), "protocol": "TCP"}]
    assert env["PROTOCOL"] == "v2", "KServe takes a custom predictor for V1 unless PROTOCOL says v2"
    _assert_grpc_probes(container, setting(env, "port"), names=("startupProbe", "livenessProbe"))
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": setting(env, "http_port")}
    # KServe's storage initializer mounts STORAGE_URI at /mnt/models.
    assert str(setting(env, "model_repository")) == "/mnt/models"
    (claim,) = _kind(KSERVE_DOCS, "PersistentVolumeClaim")
    assert env["STORAGE_URI"].rstrip("/") == f"pvc://{claim['metadata']['name']}"
    (job,) = _kind(KSERVE_DOCS, "Job")
    pod = job["spec"]["template"]["spec"]
    (export,) = pod["containers"]
    assert export["image"] == SERVICES["export"]["image"]
    assert _mount_path(export, "models")["mountPath"] == env_list(export)["ATTNSERVE_MODEL_REPOSITORY"]
    (models,) = [v for v in pod["volumes"] if v["name"] == "models"]
    assert models["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


# ---------------------------------------------------------------------------------------------
# The build context and the Makefile
# ---------------------------------------------------------------------------------------------


def test_dockerignore_keeps_models_and_virtualenvs_out():
    for path in (".venv/bin/python", "models/self_attention/1/model.onnx", ".git/HEAD", "server/__pycache__/x.pyc"):
        assert dockerignored(path), path
    for path in ("server/app.py", "deploy/healthcheck.py", "pyproject.toml", "README.md"):
        assert not dockerignored(path), path


def test_make_test_installs_nginx_first():
    makefile = (REPO_ROOT / "Makefile").read_text()
    test_prerequisites = re.search(r"^test:(.*)$", makefile, re.M).group(1).split()
    assert "nginx" in test_prerequisites
    recipe = re.search(r"^nginx:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "apt-get update" in recipe and "apt-get install -y nginx" in recipe and "command -v nginx" in recipe


def test_serving_containers_run_the_attnserve_command():
    """The manifests say what the images run: `attnserve serve`, the serving image's entrypoint."""
    from attnserve.cli import COMMANDS

    entrypoint = DOCKERFILES["deploy/Dockerfile"]["serve"].exec_form("ENTRYPOINT")
    assert entrypoint == DOCKERFILES["deploy/Dockerfile.cuda"]["serve"].exec_form("ENTRYPOINT")
    assert entrypoint[0] == "attnserve" and entrypoint[1] in COMMANDS
    for container in (_deployment_container(), _kserve_container()):
        assert container["command"] == entrypoint, container["name"]


@pytest.mark.parametrize("service", SERVER_SERVICES)
def test_compose_gives_a_stopped_replica_time_to_drain(service):
    """Docker kills a container stop_grace_period after SIGTERM: the drain delay and the grace
    period must fit inside it, so a replica that is stopped exits 0 with nothing lost."""
    env = compose_env(service)
    period = SERVICES[service]["stop_grace_period"]
    assert period.endswith("s")
    assert int(period[:-1]) > setting(env, "drain_delay_s") + setting(env, "grace_period_s"), service
