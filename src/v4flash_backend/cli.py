"""Command line: `python -m v4flash_backend {golden-check,generate,placement,release-check,trn2-check} ...`."""

from __future__ import annotations

import argparse
import sys


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

    if dist.is_available() and dist.is_initialized():  # under torchrun: leave the group cleanly
        dist.barrier()
        rank0 = is_rank0()
        dist.destroy_process_group()
        if not rank0:  # rank 0 alone reports
            return 0 if ok else 1
    for line in rep.lines:
        if args.verbose or not line.startswith("ok "):
            print(line)
    if rep.failures:
        print(f"{len(rep.failures)} check(s) failed", file=sys.stderr)
    print(final)
    return 0 if ok else 1


def cmd_generate(args) -> int:
    """`generate`: through a rank group with --world-size / --address, else in this process; both
    run the serving `Engine` (same settings, same counter-based noise), so the same request and
    seed give the same ids at every W and decode_graph."""
    from v4flash_backend.group import rank_group

    if args.world_size is not None or args.address or args.pipeline_parallel:
        return rank_group.generate_via_group(args)
    return generate_in_process(args)


def generate_in_process(args) -> int:
    """One request through an in-process Engine on the runner a W = 1 rank would build
    (`group.build.build_engine`: LocalRunner, or the static round graphs with --decode-graph static)."""
    import time

    from v4flash_backend.group import rank_group
    from v4flash_backend.group.build import InProcessRefused, build_engine
    from v4flash_backend.request import GenerateRequest, RequestError

    prompt, tok = rank_group.generate_prompt(args)
    if not prompt:
        print("error: give --prompt-ids or --prompt", file=sys.stderr)
        return 2
    settings = rank_group.generate_settings(args, prompt)
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
        req = GenerateRequest(prompt=prompt, callback=on_event, **rank_group.generate_params(args))
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
    rank_group.print_generation(tokens, last.finish_reason, last.to_wire(), tok, 1,
                                (t0, t1, first[0] if first else None, t2), report)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_backend")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("golden-check", help="check the forward against a reference fixture directory")
    g.add_argument("fixture")
    g.add_argument("--ops", default="torch", choices=["torch", "nki-sim", "nki"])
    g.add_argument("--numerics", default="reference", choices=["reference", "exact"],
                   help="reference: the reference's accumulation order, strict per-layer criteria (default); "
                        "exact: fp64 accumulation (the serving default), loose per-layer criteria")
    g.add_argument("--pipeline-parallel", type=int, default=None,
                   help="pipeline stages under torchrun (WORLD_SIZE / P ranks each; default $V4FLASH_PIPELINE or 1)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence-parallel prefill inside each stage (under torchrun)")
    g.add_argument("-v", "--verbose", action="store_true", help="print every passing check too")
    g.set_defaults(fn=cmd_golden)
    gen = sub.add_parser("generate", help="greedy or sampled generation (in this process, or a rank group)")
    gen.add_argument("--checkpoint", required=True)
    gen.add_argument("--prompt-ids", type=_ids, default=[])
    gen.add_argument("--prompt", help="text, tokenized with the checkpoint's tokenizer.json (BOS prepended)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--ops", default="torch", choices=["torch", "nki-sim", "nki"])
    from v4flash_backend.group import rank_group
    from v4flash_backend.parallel import placement

    rank_group.add_generate_arguments(gen)
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
    args = ap.parse_args(argv)
    return args.fn(args)
