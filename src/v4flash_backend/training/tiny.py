"""Build the embedded default model `models/v4flash-tiny`: a small language model of the V4.1
architecture trained here, on CPU, from the Python standard library's own source files.

One command rebuilds the committed artefact (same seed, same steps):

    python -m v4flash_backend.training --out models/v4flash-tiny

Stages: corpus split by file (train_corpus) -> byte-level BPE (train_tokenizer) -> the target,
trained through the inference forward itself with fp32 master weights and fake quantization at
every storage point (train_params) -> export to the official checkpoint layout -> DSpark stages
trained on the exported target's own greedy outputs (train_dspark) -> final export -> held-out
perplexity, DSpark acceptance and speed (train_eval) -> MODEL_CARD.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from v4flash_backend import ops
from v4flash_backend.config import ModelConfig
from v4flash_backend.model.state import ModelState, make_segments
from v4flash_backend.model.transformer import V41Model

from .loop import (
    Progress,
    balance_router,
    lr_at,
    param_groups,
    sample_batch,
    token_stream,
)
from .params import (
    export_tensors,
    forward_weights,
    inference_weights,
    init_masters,
    inventory,
    qtypes,
)

# Every block type of V4.1 at a size a 2-core CPU trains in minutes (see MODEL_CARD.md):
#   layers 0-1 window only (Engram before 1); 2 ratio-2 KV source + index source; 3 ratio-2
#   consumer; 4 ratio-1 KV source, index source and candidate source (Engram before it); 5, 7
#   ratio-1 consumers; 6 ratio-1 index source whose scores are masked by 4's candidate blocks;
#   DSpark taps 5/6/7 -> 3 window-only stages (mtp.0-2).
TINY = dict(
    vocab_size=4096, dim=128, moe_inter_dim=128, n_layers=8, n_mtp_layers=3, dspark_block_size=5,
    dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=64, dspark_n_routed_experts=4,
    dspark_n_activated_experts=2, n_heads=4, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
    q_lora_rank=64, head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=64, window_size=64,
    kv_source_layers=(2, 4), index_source_layers=(2, 4, 6), index_n_heads=4, index_head_dim=32,
    index_topk=16, candidate_source_layer=4, candidate_topk_blocks=4, candidate_block_size=8,
    engram_layer_ids=(1, 4), engram_vocab_size=1000, engram_n_heads=2, engram_head_dim=64,
    compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0), vision_n_layers=0,
)


def tiny_config(tok, **overrides) -> ModelConfig:
    """The tiny config, with the tokenizer-derived Engram sizes (the hasher refuses any others)."""
    from v4flash_backend.model.engram_hash import (
        bucket_primes,
        build_compressed_token_map,
        table_rows,
    )

    d = dict(TINY, **overrides)
    V = d["vocab_size"]
    _, csize = build_compressed_token_map(tok)
    rows = table_rows(bucket_primes(len(d["engram_layer_ids"]), d.get("engram_max_ngram_size", 4),
                                    d["engram_n_heads"], d["engram_vocab_size"]))
    return ModelConfig(**d, dspark_noise_token_id=V - 1, image_token_id=V - 2,
                       engram_compressed_vocab_size=csize, engram_num_embeddings=tuple(rows))


# ---- data ----------------------------------------------------------------------------------
def train_forward(model: V41Model, masters: dict, meta: dict, tokens: torch.Tensor, logits_rows="all",
                  want_taps: bool = False, captures: dict | None = None):
    """The inference forward (prefill from position 0, one fresh slot per row of `tokens`) over
    weights built from the masters with fake quantization. Returns the model's StepOutput."""
    cfg = model.cfg
    model.W = forward_weights(cfg, masters, meta)
    n, s = tokens.shape
    st = ModelState(cfg, n, s)
    return model.forward(st, tokens.flatten(), make_segments([(i, 0, s) for i in range(n)]), logits_rows,
                         want_taps, captures)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    n, s = tokens.shape
    lg = logits.view(n, s, -1)[:, :-1]
    return torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), tokens[:, 1:].reshape(-1))


def train_target(model: V41Model, masters: dict, train_stream, steps: int, batch: int, seq: int, lr: float,
                 seed: int, log: list) -> None:
    """Next-token cross-entropy through the fake-quantized forward; AdamW, warmup + cosine."""
    cfg = model.cfg
    names = [n for n in masters if not n.startswith("mtp.")]
    trainable = [n for n in names if not _frozen(n)]
    opt = torch.optim.AdamW(param_groups(masters, trainable, 0.05), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    meta = {"train": True, "qtype": qtypes(cfg)}
    g = torch.Generator().manual_seed(seed)
    bar = Progress(steps, "target")
    for step in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        tokens = sample_batch(train_stream, batch, seq, g)
        caps: dict = {}
        out = train_forward(model, masters, meta, tokens, captures=caps)
        loss = lm_loss(out.logits, tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([masters[n] for n in trainable], 1.0)
        opt.step()
        balance_router(masters, caps, "layers.", cfg.n_routed_experts, 1e-3)
        log.append({"step": step, "loss": round(loss.item(), 4)})
        bar.update(step, f"loss {loss.item():.3f}")


def _frozen(name: str) -> bool:
    """Parameters no gradient reaches: the indexer (its top-k is not differentiable; it keeps its
    init, a random projection) and the routing biases (moved by balance_router instead)."""
    return ".indexer." in name or name.endswith(("gate.bias", "gate.bias_vl"))


# ---- export --------------------------------------------------------------------------------
def export(cfg: ModelConfig, masters: dict, tok, out: Path) -> dict:
    """Write config.json, model.safetensors (official layout), tokenizer.json and the Hugging Face
    tokenizer files (tokenizer_config.json, special_tokens_map.json) into `out`."""
    from v4flash_backend.formats.checkpoint import write_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(cfg, masters)
    write_checkpoint(out, tensors, overwrite=True)
    cfg.to_json(out / "config.json")
    tok.save(str(out / "tokenizer.json"), pretty=False)
    from .tokenizer import write_hf_tokenizer_files

    write_hf_tokenizer_files(out, cfg.original_seq_len)
    return tensors


def inference_model(cfg: ModelConfig, tensors: dict, hasher) -> V41Model:
    return V41Model(cfg, inference_weights(cfg, tensors), hasher)


# ---- the command ---------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_backend.training", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/v4flash-tiny")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 is fastest for this op-bound model on a busy 2-core machine")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--target-steps", type=int, default=360)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--gen-prompts", type=int, default=1536,
                    help="on-policy sequences for DSpark training (fixed-5 tau by perf/draft_acceptance.py on 96 "
                         "held-out prompts / unseen code: 128 sequences x 300 steps 3.31 / 2.63, 384 x 600 "
                         "3.80 / 3.02, 768 x 900 4.04 / 3.86, 1536 x 1200 4.17 / 3.92; issue 14)")
    ap.add_argument("--gen-tokens", type=int, default=160)
    ap.add_argument("--dspark-steps", type=int, default=1200)
    ap.add_argument("--dspark-lr", type=float, default=2e-3)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--skip-target", action="store_true",
                    help="reuse the exported target in --out and retrain only DSpark (experiments; the "
                         "float-model perplexity is then that of the dequantized target)")
    a = ap.parse_args(argv)

    from v4flash_backend.model.engram_hash import EngramHasher

    from . import dspark as train_dspark
    from . import evaluate as train_eval
    from .corpus import digest, load_corpus
    from .qat_ops import fast_quant, register
    from .tokenizer import train_tokenizer

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    register()
    out = Path(a.out)
    t_start = time.time()
    train_files, held_files = load_corpus()
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "seed": a.seed, "threads": a.threads,
            "train_files": len(train_files), "heldout_files": len(held_files),
            "train_digest": digest(train_files), "heldout_digest": digest(held_files), "args": vars(a)}
    print(f"corpus: {len(train_files)} train / {len(held_files)} held-out files", file=sys.stderr)
    tok = train_tokenizer([f.text for f in train_files], a.vocab)
    cfg = tiny_config(tok, vocab_size=a.vocab)
    hasher = EngramHasher.from_config(cfg, tok)
    train_stream, held_stream = token_stream(tok, train_files), token_stream(tok, held_files)
    info.update(train_tokens=len(train_stream), heldout_tokens=len(held_stream))
    print(f"tokens: {len(train_stream)} train / {len(held_stream)} held-out", file=sys.stderr)

    masters = init_masters(cfg, a.seed)
    model = V41Model(cfg, forward_weights(cfg, masters), hasher)
    log: dict = {"target": [], "dspark": []}
    ops.set_numerics("reference")
    if a.skip_target:
        from v4flash_backend.formats.checkpoint import CheckpointReader

        with CheckpointReader(out) as r:
            for n in masters:
                if not n.startswith("mtp."):
                    masters[n].data.copy_(_master_from_export(n, r, cfg))
    else:
        ops.set_backend("train")
        t0 = time.time()
        with fast_quant():
            train_target(model, masters, train_stream, a.target_steps, a.batch, a.seq, a.lr, a.seed, log["target"])
        info["target_train_s"] = round(time.time() - t0, 1)
        ops.set_backend("torch")

    tensors = export(cfg, masters, tok, out)
    target = inference_model(cfg, tensors, hasher)
    t0 = time.time()
    with fast_quant():
        data = train_dspark.make_data(target, train_stream, a.gen_prompts, a.gen_tokens, a.seed)
    info["dspark_data_s"] = round(time.time() - t0, 1)
    ops.set_backend("train")
    t0 = time.time()
    with fast_quant():
        train_dspark.train(model, masters, data, a.dspark_steps, a.dspark_lr, a.seed, log["dspark"])
    info["dspark_train_s"] = round(time.time() - t0, 1)
    ops.set_backend("torch")
    tensors = export(cfg, masters, tok, out)
    info["train_total_s"] = round(time.time() - t_start, 1)

    report = train_eval.evaluate(out, masters, cfg, hasher, model, train_stream, held_stream, a)
    report["build"] = info
    (out / "train_log.json").write_text(json.dumps({"build": info, "log": log}, indent=1) + "\n")
    train_eval.write_card(out, cfg, tensors, report)
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    return 0


def _master_from_export(name: str, reader, cfg: ModelConfig) -> torch.Tensor:
    """fp32 value of an exported tensor (to resume from a written target)."""
    from v4flash_backend.formats import quant

    cls = inventory(cfg)[name][1]
    t = reader.get(name)
    if cls in ("fp8", "fp8_deq"):
        return quant.dequant_fp8_weight(t, reader.get(name[:-6] + "scale"))
    if cls == "fp4":
        return quant.dequant_fp4_weight(t, reader.get(name[:-6] + "scale"))
    if cls == "engram":
        return quant.dequant_fp8_rows(t, reader.get(name[:-6] + "scale"))
    return t.float()


if __name__ == "__main__":
    raise SystemExit(main())
