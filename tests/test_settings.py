"""The one settings schema: config.pbtxt, worker flags, the JSON the workers get and the
parameter table of docs/settings.md all come from `Settings`, so a setting declared once is reachable everywhere."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import pytest

from v4flash_backend.group.worker import build_parser, parse_settings
from v4flash_backend.serving.params import model_parameters
from v4flash_backend.settings import Settings, default_of, env_setting

REPO = Path(__file__).resolve().parents[1]


def _sample(f):
    """A valid non-default value for a field, as (python value, config.pbtxt string)."""
    if f.metadata["choices"]:
        v = next(c for c in f.metadata["choices"] if c != f.default)
        return v, str(v)
    if f.type == "bool":
        return (not f.default), str(not f.default).lower()
    if f.type == "int":
        return f.default + 3, str(f.default + 3)
    if f.type == "float":
        return f.default * 2 + 1.0, repr(f.default * 2 + 1.0)
    return "/tmp/x", "/tmp/x"


@pytest.mark.parametrize("name", [f.name for f in fields(Settings)])
def test_every_setting_is_a_config_pbtxt_parameter(name):
    f = next(f for f in fields(Settings) if f.name == name)
    value, text = _sample(f)
    extra = {"heartbeat_s": {"collective_timeout_s": "1000"},
             "pipeline_parallel": {"world_size": "12"},  # world_size a multiple of it
             "resident_device": {"decode_graph": "static"}}.get(name, {})  # it places the static path's state
    s, unknown = Settings.from_params({name: text, **extra})
    assert getattr(s, name) == value and unknown == {}


def test_previously_unreachable_settings_come_from_config_pbtxt():
    s, _ = Settings.from_params({"step_token_budget": "96", "queue_timeout_s": "7.5", "dspark": "false"})
    assert (s.step_token_budget, s.queue_timeout_s, s.spec_mode) == (96, 7.5, "off")


def test_bad_values_are_named():
    for params, match in [({"max_num_seqs": "0"}, "'max_num_seqs' must be >= 1"),
                          ({"prefill_chunk": "x"}, "'prefill_chunk' must be an integer"),
                          ({"spec_mode": "greedy"}, "'spec_mode' must be one of dspark, fixed, off"),
                          ({"heartbeat_s": "40"}, "'heartbeat_s' must be below half of collective_timeout_s"),
                          ({"startup_timeout_s": "-1"}, "'startup_timeout_s' must be > 0"),
                          ({"world_size": "4", "pipeline_parallel": "3"}, "must be a multiple of pipeline_parallel"),
                          ({"world_size": "2", "pipeline_parallel": "2", "decode_graph": "static"},
                           "runs the eager decode path"),
                          ({"resident_device": "cuda", "decode_graph": "eager"}, "set decode_graph static")]:
        with pytest.raises(ValueError, match=match):
            Settings.from_params(params)
    with pytest.raises(ValueError, match="unknown setting"):
        Settings.from_json(json.dumps({"max_num_seq": 3}))  # a typo in the wire form is not ignored


def test_the_repository_config_uses_only_known_parameters():
    text = (REPO / "model_repository" / "v4flash" / "config.pbtxt").read_text()
    text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    keys = re.findall(r'key\s*:\s*"([^"]+)"', text)
    assert keys, "no parameters found"
    params = {k: "" for k in keys}
    _, unknown = Settings.from_params(params)
    assert unknown == {} and set(keys) <= {f.name for f in fields(Settings)} | {"dspark"}


# Parameters model_repository/v4flash/config.pbtxt may state, each with its reason. A value equal to
# its default is allowed only as an anchor of docker/Dockerfile.neuron's edit (checked below against
# the keys that edit rewrites); a value that differs from its default must say why here.
CONFIG_ANCHORS = {"world_size", "ops_backend", "decode_graph", "startup_timeout_s", "compiled_artifacts",
                  "compile_on_miss"}
CONFIG_DIFFERS: dict[str, str] = {}  # key -> why the repository's model differs from the default


def _config_params(text: str) -> dict[str, str]:
    text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    return dict(re.findall(r'key:\s*"([^"]+)",\s*value:\s*{\s*string_value:\s*"([^"]*)"', text))


def _config_problems(params: dict[str, str]) -> list[str]:
    """What config.pbtxt states without a reason: a default restated outside the image's anchors, or a
    value that differs from its default without an entry in CONFIG_DIFFERS."""
    default = Settings()
    by_name = {f.name: f for f in fields(Settings)}
    problems = []
    for key, raw in params.items():
        if key == "dspark":  # the on/off alias of spec_mode
            key, raw = "spec_mode", ("dspark" if raw.strip().lower() in ("1", "true", "yes", "on") else "off")
        given, _ = Settings.from_params({key: raw})
        same = getattr(given, key) == getattr(default, key)  # an empty value keeps the default too
        if same and key not in CONFIG_ANCHORS:
            problems.append(f"{key}: restates its default {by_name[key].default!r}")
        if not same and key not in CONFIG_DIFFERS:
            problems.append(f"{key}: {raw!r} contradicts its default {by_name[key].default!r} with no reason")
    return problems


def test_config_pbtxt_states_only_what_differs_from_the_defaults():
    """Every default lives in `Settings`; config.pbtxt restating one (a second place to change) or
    contradicting one without a reason in CONFIG_DIFFERS fails."""
    text = (REPO / "model_repository" / "v4flash" / "config.pbtxt").read_text()
    assert _config_problems(_config_params(text)) == []
    # the anchors are exactly the keys the Neuron image's RUN rewrites
    docker = (REPO / "docker" / "Dockerfile.neuron").read_text()
    assert set(re.findall(r'/key: \\?"([a-z_]+)\\?"/s[/|]', docker)) == CONFIG_ANCHORS
    # a contradicting value or a restated default is caught
    assert _config_problems({"max_num_seqs": "4"}) == ["max_num_seqs: '4' contradicts its default 8 with no reason"]
    assert _config_problems({"max_queue_size": "64"}) == ["max_queue_size: restates its default 64"]
    assert _config_problems({"dspark": "false"})[0].startswith("spec_mode: 'off' contradicts")


def test_the_workers_receive_exactly_the_settings_and_flags_win():
    s = Settings(checkpoint_dir="/ckpt", world_size=2, max_num_seqs=3, step_token_budget=77, spec_mode="fixed",
                 queue_timeout_s=9.0, ops_backend="nki-sim")
    assert Settings.from_json(s.to_json()) == s
    args, got = parse_settings(build_parser(), ["--settings-json", s.to_json(), "--max-num-seqs", "5"])
    assert got == s.replace(max_num_seqs=5) and args.host == "127.0.0.1"
    # generated flags and the legacy spellings of the old worker command line
    _, got = parse_settings(build_parser(), ["--checkpoint", "/c", "--ops", "nki-sim", "--timeout-s", "30",
                                             "--backend", "gloo", "--step-token-budget", "64",
                                             "--queue-timeout-s", "3"])
    assert (got.checkpoint_dir, got.ops_backend, got.collective_timeout_s, got.dist_backend,
            got.step_token_budget, got.queue_timeout_s) == ("/c", "nki-sim", 30.0, "gloo", 64, 3.0)
    with pytest.raises(SystemExit):
        parse_settings(build_parser(), ["--max-num-seqs", "2"])  # no checkpoint


def test_the_settings_page_table_is_the_schema():
    page = (REPO / "docs" / "settings.md").read_text()
    m = re.search(r"<!-- settings-table -->\n(.*?)\n<!-- /settings-table -->", page, re.S)
    assert m, "docs/settings.md lacks the settings table markers"
    assert m.group(1).strip() == Settings.markdown_table().strip(), (
        "docs/settings.md's parameter table differs from settings.Settings; paste the output of "
        "python -c 'from v4flash_backend.settings import Settings; print(Settings.markdown_table())'")


def test_model_parameters_of_a_triton_config_round_trip():
    cfg = {"parameters": {"max_num_seqs": {"string_value": "4"}, "tokenizer_dir": {"string_value": ""}}}
    s, unknown = Settings.from_params(model_parameters(cfg))
    assert s.max_num_seqs == 4 and s.tokenizer_dir == "" and unknown == {}


def test_environment_overrides_are_declared_on_their_fields():
    """The variables that override settings are named on the fields (`env=`) and read by
    `with_env_overrides` alone: each sets its own field; empty or undeclared variables change nothing."""
    declared = {f.metadata["env"]: f for f in fields(Settings) if f.metadata["env"]}
    assert {"NEURON_LOGICAL_NC_CONFIG", "NEURON_CC_FLAGS", "V4FLASH_NEURON_CACHE", "V4FLASH_NEURON_BACKEND",
            "V4FLASH_DIST_BACKEND"} <= set(declared)
    base = Settings(world_size=4)  # a multiple of every sampled pipeline_parallel
    for var, f in declared.items():
        value, text = _sample(f)
        if var == "NEURON_CC_FLAGS":
            value = text = "-O2"
        assert base.with_env_overrides({var: text}) == base.replace(**{f.name: value}), var
    assert base.with_env_overrides({"V4FLASH_MAX_NUM_SEQS": "3", "NEURON_LOGICAL_NC_CONFIG": " "}) == base
    assert "`$NEURON_CC_FLAGS`" in Settings.markdown_table()


def test_processes_without_settings_read_the_same_overrides():
    """golden-check, the checks and the test ranks resolve pipeline stages, threads and the dist
    backend through `env_setting` (declared default, else the field's override, parsed and checked)."""
    assert {"V4FLASH_PIPELINE", "V4FLASH_THREADS"} <= {f.metadata["env"] for f in fields(Settings)}
    assert (env_setting("pipeline_parallel", {}), env_setting("threads", {"V4FLASH_THREADS": " "})) == (1, 1)
    assert env_setting("pipeline_parallel", {"V4FLASH_PIPELINE": "2"}) == 2
    assert env_setting("dist_backend", {"V4FLASH_DIST_BACKEND": "gloo"}) == "gloo"
    with pytest.raises(ValueError, match="'threads' must be >= 1"):
        env_setting("threads", {"V4FLASH_THREADS": "0"})
    # the served ranks get the same variables through with_env_overrides
    assert Settings(world_size=4).with_env_overrides({"V4FLASH_PIPELINE": "2"}).pipeline_parallel == 2
    # request defaults come from the one declaration
    from v4flash_backend.request import GenerateRequest

    assert GenerateRequest(prompt=[1]).max_tokens == default_of("default_max_tokens") == Settings().default_max_tokens
