"""Command line: `python -m v4flash_backend {golden-check,generate,placement,release-check} ...`."""

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
    if args.world_size is not None or args.address or args.decode_graph or args.step_report or args.pipeline_parallel:
        from v4flash_backend.group import rank_group

        return rank_group.generate_via_group(args)
    from v4flash_backend import ops
    from v4flash_backend.engine.single import generate_single
    from v4flash_backend.model.loading import load_model

    ops.set_backend(args.ops)
    model = load_model(args.checkpoint)
    prompt = args.prompt_ids
    tok = None
    if args.prompt is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(f"{args.checkpoint}/tokenizer.json")
        prompt = [model.cfg.bos_token_id] + tok.encode(args.prompt, add_special_tokens=False).ids
    if not prompt:
        print("error: give --prompt-ids or --prompt", file=sys.stderr)
        return 2
    try:
        g = generate_single(model, prompt, args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                     ignore_eos=args.ignore_eos)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("output_ids:", " ".join(map(str, g.tokens)))
    if tok is not None:
        print("text:", tok.decode(g.tokens))
    n = len(g.tokens)
    print(f"finish_reason={g.finish_reason} tokens={n} prefill_s={g.prefill_s:.3f} "
          f"decode_tok_s={(n - 1) / g.decode_s if n > 1 and g.decode_s > 0 else 0:.1f}")
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
    gen = sub.add_parser("generate", help="greedy or sampled generation in this process")
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
    args = ap.parse_args(argv)
    return args.fn(args)
