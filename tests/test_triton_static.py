"""End to end on the static decode path: the real tritonserver (scripts/serve.sh) serving v4flash
and v4flash_text with `decode_graph: static` at `world_size: 2` (a torchrun rank group of two gloo
ranks running the round graphs, sampling inside them).

Concurrent requests of different lengths, greedy and seeded sampling, through both models, must
stream exactly the tokens / text of the eager path, which is computed here by the in-process
engine (LocalRunner, W = 1, exact numerics) with the same settings: spec_mode fixed (admission by
a fixed length: a profiled SPS table would be a timing, different per run, and sampled tokens
depend on admission). Cancellations free their slots; the metrics report 2 graph executions and 0
host syncs per decode step.
"""

from pathlib import Path

import pytest
from tokenizers import Tokenizer

import test_triton_e2e as e2e  # noqa: E402 - the helpers of the eager e2e module (same directory)
from _triton import start_serve, stop, wait_ready

REPO = e2e.REPO
GOLDEN = e2e.GOLDEN
SLOTS, MAX_LEN, FIXED = 4, 64, 3

pytestmark = pytest.mark.slow


def _build(root: Path) -> Path:
    repo = e2e._build_repository(root)
    cfg = (repo / "v4flash" / "config.pbtxt").read_text()
    for key, value in (("decode_graph", "static"), ("world_size", "2"), ("dspark", "true")):
        cfg = e2e._set_param(cfg, key, value)
    cfg += 'parameters { key: "spec_mode", value: { string_value: "fixed" } }\n'
    cfg += f'parameters {{ key: "fixed_len", value: {{ string_value: "{FIXED}" }} }}\n'
    (repo / "v4flash" / "config.pbtxt").write_text(cfg)
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (REPO / ".triton/backends/python/triton_python_backend_stub").exists():
        pytest.fail("tritonserver is not set up: run `make triton` (scripts/setup_triton.sh)")
    root = tmp_path_factory.mktemp("triton_static")
    repo = _build(root)
    log_path = root / "tritonserver.log"
    proc, server = start_serve(repo, log_path)
    try:
        wait_ready(proc, server["http_port"], log_path, 2 * e2e.READY_TIMEOUT_S, tail=6000)
        yield server
    finally:
        stop(proc, 60)


@pytest.fixture(scope="module")
def eager(tiny_model):
    """The eager path's tokens for (prompt ids, max_tokens, temperature, seed)."""
    from v4flash_backend.engine.engine import Engine
    from v4flash_backend.engine.runner import LocalRunner
    from v4flash_backend.request import GenerateRequest
    from v4flash_backend.settings import Settings

    def run(prompt, max_tokens, temperature=0.0, seed=None):
        eng = Engine(LocalRunner(tiny_model, SLOTS + 1, MAX_LEN),
                     Settings(max_num_seqs=SLOTS, max_model_len=MAX_LEN, spec_mode="fixed", fixed_len=FIXED))
        ev = eng.run_request(GenerateRequest(prompt=list(prompt), max_tokens=max_tokens, temperature=temperature,
                                             seed=seed, ignore_eos=True))
        return [t for e in ev for t in e.token_ids]
    return run


def test_concurrent_greedy_and_seeded_requests_stream_the_eager_tokens(server, eager):
    reqs = [(e2e.PROMPT_IDS, 12, 0.0, None), (e2e.PROMPT_IDS[:3], 5, 0.8, 7),
            ([0, 5, 9, 300, 41, 2, 77, 8], 9, 0.8, 11), ([0, 1000, 3], 7, 0.0, None)]

    def call(p, k, t, s):
        kw = dict(model="v4flash", input_ids=p, stream=True, max_tokens=k, temperature=t,
                  exclude_input_in_output=True)
        if s is not None:
            kw["seed"] = s
        return lambda: [i for c in e2e._grpc(server, **kw) for i in c.output_ids]

    got = e2e._concurrently(*[call(*r) for r in reqs])
    want = [eager(p, k, t, s) for p, k, t, s in reqs]
    assert got == want


def test_text_ensemble_streams_the_eager_text(server, eager):
    tok = Tokenizer.from_file(str(GOLDEN / "tokenizer.json"))
    prompt = tok.encode(e2e.PROMPT_TEXT).ids  # what the preprocessing model feeds v4flash
    events = e2e._sse(server, "v4flash_text", {"text_input": e2e.PROMPT_TEXT, "max_tokens": 10, "temperature": 0.8,
                                              "seed": 7, "ignore_eos": True, "exclude_input_in_output": True})
    text = "".join(e["text_output"] for e in events)
    assert text == tok.decode(eager(prompt, 10, 0.8, 7), skip_special_tokens=True)


def test_cancelling_frees_the_slot_and_metrics_report_the_static_path(server):
    import tritonclient.grpc as grpcclient  # noqa: F401 - the client module the helper drives

    from v4flash_backend.client import generate

    for _ in generate(url=server["grpc"], timeout_s=120, model="v4flash", input_ids=e2e.PROMPT_IDS, stream=True,
                      max_tokens=40, ignore_eos=True):
        break  # leaving the loop cancels the request
    e2e._wait_metrics(server, lambda m: m.get("v4flash:kv_slots_in_use") == 0, timeout=30)
    m = e2e._metrics(server)
    assert m["v4flash:decode_steps"] > 0
    assert m["v4flash:decode_graph_executions_per_step"] <= 2
    assert m["v4flash:decode_host_syncs_per_step"] == 0
    assert m["v4flash:static_fallback_steps"] == 0  # every decode step ran the round graphs
    # spec_mode fixed (dspark_adaptive decides for spec_mode dspark only): every decode step drafted
    assert m["v4flash:decode_steps_by_kind[draft]"] == m["v4flash:decode_steps"]
    assert m["v4flash:decode_steps_by_kind[probe]"] == m["v4flash:decode_steps_by_kind[aside]"] == 0
