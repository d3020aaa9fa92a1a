"""perf/run_aiperf.sh without AIPerf: a stand-in `aiperf` in a fake venv records its arguments and
writes an export shaped like AIPerf 0.13's profile_export_aiperf.json, so the test checks what the
script asks AIPerf for (template endpoint on generate_stream, streaming, fixed lengths), that the
template renders valid JSON the way AIPerf renders it (jinja2, autoescape on), and the summary line.
A real run against `make serve` is in the report of issue 34 (one short run; it costs CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2

REPO = Path(__file__).resolve().parents[1]
FAKE_AIPERF = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$ARGS_FILE"
out=; prev=
for a in "$@"; do [[ $prev == --artifact-dir ]] && out=$a; prev=$a; done
cat > "$out/profile_export_aiperf.json" <<'EOF'
{"time_to_first_token": {"unit": "ms", "avg": 462.18}, "inter_token_latency": {"unit": "ms", "avg": 98.5},
 "output_token_throughput": {"unit": "tokens/sec", "avg": 15.64}, "request_count": {"unit": "requests", "avg": 8.0},
 "error_request_count": {"unit": "requests", "avg": 1.0}}
EOF
"""


def _fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "aiperf").write_text(FAKE_AIPERF)
    (venv / "bin" / "aiperf").chmod(0o755)
    (venv / "bin" / "python").symlink_to(sys.executable)
    return venv


def test_the_script_profiles_generate_stream_with_fixed_lengths(tmp_path):
    venv, out, args_file = _fake_venv(tmp_path), tmp_path / "out", tmp_path / "args"
    env = dict(os.environ, AIPERF_VENV=str(venv), OUT=str(out), ARGS_FILE=str(args_file), ISL="40", OSL="24")
    r = subprocess.run(["bash", str(REPO / "perf" / "run_aiperf.sh"), "--url", "http://127.0.0.1:18000"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last == "aiperf: ttft_ms=462.18 itl_ms=98.50 output_tok_s=15.64 requests=8 errors=1", last

    args = args_file.read_text().splitlines()
    opt = {a: args[k + 1] for k, a in enumerate(args[:-1]) if a.startswith("--")}
    assert args[0] == "profile" and "--streaming" in args
    assert opt["--url"] == "http://127.0.0.1:18000" and opt["--model"] == "v4flash_text"
    assert opt["--endpoint-type"] == "template"
    assert opt["--custom-endpoint"] == "/v2/models/v4flash_text/generate_stream"
    assert (opt["--synthetic-input-tokens-mean"], opt["--synthetic-input-tokens-stddev"]) == ("40", "0")
    assert (opt["--output-tokens-mean"], opt["--output-tokens-stddev"]) == ("24", "0")
    extra = [args[k + 1] for k, a in enumerate(args) if a == "--extra-inputs"]
    assert "response_field:text_output" in extra
    template_path = Path(next(e for e in extra if e.startswith("payload_template:")).split(":", 1)[1])
    # rendered as AIPerf's TemplateEndpoint renders it: a prompt with quotes, commas, newlines stays one string
    text = 'He said "stop", then\nleft, <b>&</b>'
    rendered = jinja2.Environment(autoescape=True).from_string(template_path.read_text()).render(text=text)
    assert json.loads(rendered) == {"text_input": text, "max_tokens": 24, "ignore_eos": True, "stream": True}


def test_the_url_is_required(tmp_path):
    r = subprocess.run(["bash", str(REPO / "perf" / "run_aiperf.sh")], capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, AIPERF_VENV=str(tmp_path / "none")))
    assert r.returncode == 2 and "usage" in r.stderr


def test_the_openai_mode_profiles_chat_completions_with_the_key(tmp_path):
    venv, out, args_file = _fake_venv(tmp_path), tmp_path / "out", tmp_path / "args"
    key = tmp_path / "key"
    key.write_text("k" * 20 + "\n")
    env = dict(os.environ, AIPERF_VENV=str(venv), OUT=str(out), ARGS_FILE=str(args_file), OSL="16")
    r = subprocess.run(["bash", str(REPO / "perf" / "run_aiperf.sh"), "--openai", "--api-key-file", str(key),
                        "--url", "http://127.0.0.1:19000"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("aiperf: ttft_ms=462.18 ")
    args = args_file.read_text().splitlines()
    opt = {a: args[k + 1] for k, a in enumerate(args[:-1]) if a.startswith("--")}
    assert opt["--endpoint-type"] == "chat" and opt["--model"] == "v4flash" and "--streaming" in args
    assert opt["--url"] == "http://127.0.0.1:19000" and opt["--api-key"] == "k" * 20
    assert "--use-server-token-count" in args and "--custom-endpoint" not in args
    assert [args[k + 1] for k, a in enumerate(args) if a == "--extra-inputs"] == ["ignore_eos:true"]
    assert (opt["--output-tokens-mean"], opt["--output-tokens-stddev"]) == ("16", "0")
