"""Command line: `python -m v4flash_backend {golden-check,generate,placement,release-check,trn2-check,compile,
device-standin} ...`."""

from __future__ import annotations

import argparse
import sys
import time


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes integers separated by commas or spaces, got {text!r}")


def cmd_golden(args) -> int:
    from v4flash_backend.checks.golden import golden_check
    from v4flash_backend.parallel.collectives import is_rank0

    ok, final, rep = golden_check(args.fixture, args.ops, args.numerics, args.pipeline_parallel,
                                  args.sequence_parallel)
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    if grouped:  # under torchrun: leave the group cleanly
        dist.barrier()
        rank0 = is_rank0()
        dist.destroy_process_group()
        if not rank0:  # rank 0 alone reports
            _leave(0 if ok else 1)
    for line in rep.lines:
        if args.verbose or not line.startswith("ok "):
            print(line)
    if rep.failures:
        print(f"{len(rep.failures)} check(s) failed", file=sys.stderr)
    print(rep.level_line)
    print(final)
    if grouped:
        _leave(0 if ok else 1)
    return 0 if ok else 1


def _leave(code: int) -> None:
    """Exit a torchrun rank whose process group is destroyed without the interpreter's unwinding:
    even after the barrier and destroy, a rank of a W = 4 golden-check aborted once while unwinding
    ('terminate called without an active exception', SIGABRT from a C++ thread's destructor; CI on
    a 2-core AMD EPYC, 2026-12-07), failing a check that had passed. Output is flushed first."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_generate(args) -> int:
    """`generate`: through a rank group with --world-size / --address, else in this process; both
    run the serving `Engine` (same settings, same counter-based noise), so the same request and
    seed give the same ids at every W and decode_graph."""
    if args.world_size is not None or args.address or args.pipeline_parallel:
        return generate_via_group(args)
    return generate_in_process(args)


def generate_in_process(args) -> int:
    """One request through an in-process Engine on the runner a W = 1 rank would build
    (`group.build.build_engine`: LocalRunner, or the static round graphs with --decode-graph static)."""
    import time

    from v4flash_backend.group.build import InProcessRefused, build_engine
    from v4flash_backend.request import GenerateRequest, RequestError

    prompt, tok = generate_prompt(args)
    if not prompt:
        print("error: give --prompt-ids or --prompt", file=sys.stderr)
        return 2
    settings = generate_settings(args, prompt)
    t0 = time.perf_counter()
    try:
        engine = build_engine(settings)
    except InProcessRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    events, first = [], []

    def on_event(e):
        if e.token_ids and not first:
            first.append(time.perf_counter())
        events.append(e)

    try:
        req = GenerateRequest(prompt=prompt, callback=on_event, **generate_params(args))
        engine.run_request(req)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t2 = time.perf_counter()
    last = events[-1]
    if last.error is not None:
        print(f"error: {last.error_code}: {last.error}", file=sys.stderr)
        return 1
    tokens = [t for e in events for t in e.token_ids]
    report = engine.stats() if args.step_report else None
    print_generation(tokens, last.finish_reason, last.to_wire(), tok, 1,
                                (t0, t1, first[0] if first else None, t2), report)
    return 0


# ---- `generate`: its flags, settings and output (in process and through a rank group alike) -----------
# The settings a `generate` run takes from its command line: their flags (names, types, choices,
# help) are generated from `Settings`, so a new choice or a renamed value cannot drift from the schema.
GENERATE_SETTINGS = ("checkpoint_dir", "ops_backend", "world_size", "decode_graph", "graph_backend", "spec_mode",
                     "pipeline_parallel", "sps_path", "group_secret_file")


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    """The `generate` subcommand's flags: the request's, the settings' (from `Settings`), the rank group's."""
    from v4flash_backend.settings import Settings

    gen.add_argument("--prompt-ids", type=_ids, default=[])
    gen.add_argument("--prompt", help="text, tokenized with the checkpoint's tokenizer.json (BOS prepended)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    Settings.add_arguments(gen, scopes=(), extra=GENERATE_SETTINGS)
    gen.set_defaults(ops_backend="torch")  # always set: it names the SPS cache file (default_sps_path)
    for action in gen._actions:  # the generated flags default to "not given"; a run needs its checkpoint
        if action.dest == "checkpoint_dir":
            action.required = True
    # a bare switch here (Settings' bool flags take a value): same dest, so None still means "not given"
    gen.add_argument("--sequence-parallel", action="store_true", default=None,
                     help="sequence-parallel prefill inside each stage of the rank group")
    gen.add_argument("--address", default=None, help="use a running rank group at host:port (--group-secret-file: "
                                                     "its shared secret, default $V4FLASH_GROUP_SECRET_FILE, else "
                                                     "$V4FLASH_GROUP_SECRET)")
    gen.add_argument("--python", default=None, help="interpreter for the workers (default: the repo's .venv)")
    gen.add_argument("--step-report", action="store_true",
                     help="end with the lines 'ids: ...' and 'step-report: ...' (decode-step counts)")


def generate_prompt(args):
    """(prompt ids, tokenizer or None) of the `generate` subcommand: --prompt TEXT is tokenized with
    the checkpoint's tokenizer (BOS prepended), else --prompt-ids."""
    prompt = list(args.prompt_ids or [])
    tok = None
    if getattr(args, "prompt", None) is not None:
        from tokenizers import Tokenizer

        from v4flash_backend.config import ModelConfig

        tok = Tokenizer.from_file(f"{args.checkpoint_dir}/tokenizer.json")
        prompt = [ModelConfig.from_json(args.checkpoint_dir).bos_token_id] + tok.encode(
            args.prompt, add_special_tokens=False).ids
    return prompt, tok


def generate_params(args) -> dict:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
              "top_p": args.top_p, "ignore_eos": bool(args.ignore_eos)}
    if args.seed is not None:
        params["seed"] = args.seed
    return params


def generate_settings(args, prompt: list[int]):
    """The Settings of a `generate` run, the same in process and in a rank group of any W (one
    slot, the prompt's length plus max_tokens, the shared SPS table; default: `default_sps_path`,
    so seeded sampled runs agree across W and decode_graph: admission depends on the table)."""
    from v4flash_backend.settings import Settings

    # on the CPU ops, decode_graph eager unless named: a one-shot run would end before a background
    # compile of the CPU default's graphs (minutes) served a step, and the compile would compete with it
    cpu = (args.ops_backend or "torch") == "torch"
    extra = {k: v for k, v in (("decode_graph", getattr(args, "decode_graph", None) or ("eager" if cpu else None)),
                               ("graph_backend", getattr(args, "graph_backend", None)),
                               ("spec_mode", getattr(args, "spec_mode", None)),
                               ("pipeline_parallel", getattr(args, "pipeline_parallel", None)),
                               ("sequence_parallel", getattr(args, "sequence_parallel", None)),
                               ("sps_path", getattr(args, "sps_path", None) or default_sps_path(args)),
                               ("count_host_syncs", bool(getattr(args, "step_report", False)))) if v}
    # step_cost_online off: admission then reads the saved table alone, never this run's timings,
    # so the same seed gives the same ids at every W and decode_graph (a server learns; see README)
    return Settings(checkpoint_dir=args.checkpoint_dir, world_size=args.world_size or 1,
                    ops_backend=args.ops_backend or "torch", max_num_seqs=1,
                    max_model_len=len(prompt) + args.max_tokens + 8, step_cost_online=False, **extra)


def print_generation(tokens, reason, last, tok, world, times, report) -> None:
    """The `generate` output (in process and through a rank group alike); times = (t0 start,
    t1 ready, first token or None, t2 end)."""
    t0, t1, first, t2 = times
    print("output_ids:", " ".join(map(str, tokens)))
    if tok is not None:
        print("text:", tok.decode(tokens))
    n = len(tokens)
    dec = t2 - (first or t2)
    print(f"finish_reason={reason} tokens={n} world_size={world} start_s={t1 - t0:.1f} "
          f"ttft_s={(first or t2) - t1:.3f} decode_tok_s={(n - 1) / dec if n > 1 and dec > 0 else 0:.1f} "
          f"drafted={last['drafted']} accepted={last['accepted']}")
    if report is not None:
        print(step_report_lines(tokens, report, world), end="")


def generate_via_group(args) -> int:
    """The `generate` subcommand through a rank group; prints like the in-process command."""
    from v4flash_backend.group.rank_group import RankGroup

    prompt, tok = generate_prompt(args)
    if not prompt:
        print("error: give --prompt-ids or --prompt", file=sys.stderr)
        return 2
    params = generate_params(args)
    t0 = time.perf_counter()
    if args.address:
        group = RankGroup.connect(args.address, secret_file=getattr(args, "group_secret_file", None))
    else:
        group = RankGroup.launch(generate_settings(args, prompt), python=args.python)
    t1 = time.perf_counter()
    try:
        st = group.submit(prompt, params)
        first = None
        tokens, reason, last = [], None, None
        for ev in st:
            if ev.get("event") == "error":
                print(f"error: {ev.get('code')}: {ev.get('message')}", file=sys.stderr)
                return 2 if ev.get("code") == "INVALID_ARG" else 1
            if ev["token_ids"] and first is None:
                first = time.perf_counter()
            tokens += ev["token_ids"]
            reason, last = ev["finish_reason"], ev
        t2 = time.perf_counter()
        report = group.stats().get("engine", {}) if getattr(args, "step_report", False) else None
    finally:
        if not args.address:
            group.shutdown()
    print_generation(tokens, reason, last, tok, group.info.get("world_size"), (t0, t1, first, t2), report)
    return 0


def default_sps_path(args) -> str:
    """The CLI's SPS table cache, one per checkpoint and ops backend (not per W or mode): DSpark
    admission reads the table, which is a timing, so a seeded T > 0 run is reproducible -- across
    runs, W and decode_graph -- only with the same table. The first run profiles and saves it,
    later runs load it ($V4FLASH_CACHE_DIR, default ~/.cache/v4flash; --sps-path picks another)."""
    import hashlib
    import os

    root = os.environ.get("V4FLASH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "v4flash")
    os.makedirs(root, exist_ok=True)
    key = hashlib.sha1(f"{os.path.realpath(args.checkpoint_dir)}|{args.ops_backend}".encode()).hexdigest()
    return os.path.join(root, f"sps-{key[:16]}.json")


def step_report_lines(tokens, st: dict, world) -> str:
    """The two closing lines of `generate --step-report` (their format is part of the interface).
    Per-step figures are over decode steps (steps with no prefill rows); graphs_per_step and
    host_syncs_per_step print as integers when they are whole."""
    def num(v):
        if v is None:
            return "n/a"  # not counted (an eager runner without count_host_syncs)
        return str(int(v)) if float(v).is_integer() else f"{v:.2f}"

    return (f"ids: {','.join(map(str, tokens))}\n"
            f"step-report: decode_graph={st.get('decode_graph')} world={world} steps={st.get('decode_steps', 0)} "
            f"graphs_per_step={num(st.get('graphs_per_step', 0))} "
            f"host_syncs_per_step={num(st.get('host_syncs_per_step', 0))} "
            f"host_to_device_bytes_per_step={int(round(st.get('host_to_device_bytes_per_step', 0)))}\n")


def main(argv=None) -> int:
    from v4flash_backend.settings import NUMERICS, OPS_BACKENDS

    ap = argparse.ArgumentParser(prog="python -m v4flash_backend")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("golden-check", help="check the forward against a reference fixture directory")
    g.add_argument("fixture")
    g.add_argument("--ops", default="torch", choices=OPS_BACKENDS)
    g.add_argument("--numerics", default="reference", choices=[n for n in NUMERICS if n],
                   help="reference: the reference's accumulation order, strict per-layer criteria (default); "
                        "exact: fp64 accumulation (the serving default), loose per-layer criteria")
    g.add_argument("--pipeline-parallel", type=int, default=None,
                   help="pipeline stages under torchrun (WORLD_SIZE / P ranks each; default $V4FLASH_PIPELINE or 1)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence-parallel prefill inside each stage (under torchrun)")
    g.add_argument("-v", "--verbose", action="store_true", help="print every passing check too")
    g.set_defaults(fn=cmd_golden)
    gen = sub.add_parser("generate", help="greedy or sampled generation (in this process, or a rank group)")
    from v4flash_backend.parallel import placement

    add_generate_arguments(gen)
    gen.set_defaults(fn=cmd_generate)
    pl = sub.add_parser("placement", help="bytes per rank and collectives per step of the trn2 layout (no tensors)")
    placement.add_arguments(pl)
    pl.set_defaults(fn=placement.main)
    from v4flash_backend.checks import release

    rc = sub.add_parser("release-check", help="release-shaped checkpoint load of one rank, static graphs traced "
                                              "at release shapes, kernel SBUF/PSUM footprints (no release bytes)")
    release.add_arguments(rc)
    rc.set_defaults(fn=release.main)
    from v4flash_backend.checks import trn2

    tc = sub.add_parser("trn2-check", help="one rank's static graphs traced on fake device tensors: device-clean, "
                                           "trn2 dtypes, kernel nodes, host reads; the Neuron launch environment")
    trn2.add_arguments(tc)
    tc.set_defaults(fn=trn2.main)
    from v4flash_backend.group import aot

    cp = sub.add_parser("compile", help="every start-up graph of a static server compiled once, ahead of time, "
                                        "into artifacts every rank loads (compiled_artifacts)")
    aot.add_arguments(cp)
    cp.set_defaults(fn=aot.main)
    from v4flash_backend.checks import standin

    sd = sub.add_parser("device-standin", help="the served static path on a stand-in accelerator (a GPU): no host "
                                               "sync inside a step, no weight or cache copy, the CPU eager ids")
    standin.add_arguments(sd)
    sd.set_defaults(fn=standin.main)
    args = ap.parse_args(argv)
    return args.fn(args)
