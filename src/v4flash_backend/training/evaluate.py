"""Evaluation of the embedded tiny model: held-out perplexity (exported vs unigram), a
batch-1 greedy speculative loop measuring DSpark acceptance and speed, and the model card.

The speculative loop here is the simplest correct one (the engine has the production loop):
prefill the prompt with taps, write every prompt row into the DSpark rings, take the target's
argmax as the anchor; then repeatedly draft B tokens (Markov-chained argmax), verify
[anchor, drafts] in one target forward (all rows' logits and taps), accept the longest prefix equal
to the target's argmax, commit it plus the target's next token (the bonus), and write the rings
for the committed rows only (anchor + accepted drafts; the bonus becomes the next anchor).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from v4flash_backend.model.dspark import DSparkDrafter
from v4flash_backend.model.state import ModelState, make_segments


# ---- perplexity ----------------------------------------------------------------------------
@torch.no_grad()
def mean_nll(model, tokens: torch.Tensor, chunk: int = 4) -> float:
    """Mean next-token NLL (nats) of the inference forward over sequences [N, S] (positions 1..S-1)."""
    total, count = 0.0, 0
    for i in range(0, len(tokens), chunk):
        t = tokens[i:i + chunk]
        n, s = t.shape
        st = ModelState(model.cfg, n, s)
        lg = model.forward(st, t.flatten(), make_segments([(j, 0, s) for j in range(n)]), "all").logits
        lp = lg.view(n, s, -1)[:, :-1].log_softmax(-1)
        total -= lp.gather(-1, t[:, 1:].unsqueeze(-1)).sum().item()
        count += n * (s - 1)
    return total / count


def unigram_nll(train_stream: torch.Tensor, tokens: torch.Tensor, vocab: int) -> float:
    """Mean NLL of the same held-out targets under add-one-smoothed train-split token frequencies."""
    counts = torch.bincount(train_stream.long(), minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return -logp[tokens[:, 1:].flatten()].mean().item()


# ---- speculative decoding at temperature 0 -----------------------------------------------------
@torch.no_grad()
def spec_generate(model, drafter: DSparkDrafter, prompt: list[int], max_new: int):
    """Greedy DSpark decoding at batch 1: (tokens, accepted drafts per verify step, decode seconds,
    mean confidence per draft position)."""
    B = drafter.B
    L = len(prompt)
    st = ModelState(model.cfg, 1, L + max_new + B + 2)
    out = model.forward(st, torch.tensor(prompt), make_segments([(0, 0, L)]), "last", want_taps=True)
    drafter.write_ring(st, 0, drafter.main_x(out.taps), torch.arange(L))
    y = int(out.logits[-1].argmax())
    gen, accepted, conf = [y], [], []
    pos = L  # position of the anchor y
    t0 = time.perf_counter()
    while len(gen) < max_new:
        d = drafter.draft(st, [(0, pos - 1, y)])
        ids, _, c = drafter.greedy_chain(d, torch.tensor([y]))
        conf.append(torch.sigmoid(c[0]))
        drafts = ids[0, 1:]
        v = model.forward(st, torch.cat([torch.tensor([y]), drafts]), make_segments([(0, pos, B + 1)]), "all",
                          want_taps=True)
        tgt = v.logits.argmax(-1)  # tgt[j]: the target's token at position pos + 1 + j
        a = 0
        while a < B and int(drafts[a]) == int(tgt[a]):
            a += 1
        accepted.append(a)
        gen += drafts[:a].tolist() + [int(tgt[a])]
        drafter.write_ring(st, 0, drafter.main_x(v.taps[:a + 1]), torch.arange(pos, pos + a + 1))
        pos += a + 1
        y = int(tgt[a])
    dt = time.perf_counter() - t0
    return gen[:max_new], accepted, dt, torch.stack(conf).mean(0).tolist() if conf else []


@torch.no_grad()
def plain_generate(model, prompt: list[int], max_new: int):
    """Greedy decoding one token per forward: (tokens, decode seconds)."""
    L = len(prompt)
    st = ModelState(model.cfg, 1, L + max_new + 1)
    out = model.forward(st, torch.tensor(prompt), make_segments([(0, 0, L)]))
    gen = [int(out.logits[-1].argmax())]
    t0 = time.perf_counter()
    while len(gen) < max_new:
        out = model.forward(st, torch.tensor(gen[-1:]), make_segments([(0, L + len(gen) - 1, 1)]))
        gen.append(int(out.logits[-1].argmax()))
    return gen, time.perf_counter() - t0


def acceptance_stats(accepted: list[int], B: int) -> dict:
    """tau (accepted + bonus per verify step), per-position conditional acceptance
    P(draft k accepted | drafts < k accepted) and survival P(at least k accepted)."""
    acc = torch.tensor(accepted)
    reached = [(acc >= k).sum().item() for k in range(B + 1)]
    cond = [round(reached[k + 1] / reached[k], 3) if reached[k] else None for k in range(B)]
    surv = [round(reached[k + 1] / len(acc), 3) for k in range(B)]
    return {"verify_steps": len(acc), "mean_accepted": round(acc.float().mean().item(), 3),
            "tau": round(acc.float().mean().item() + 1, 3), "accept_conditional": cond, "accept_survival": surv}


def heldout_prompts(held_stream: torch.Tensor, n: int, length: int, bos: int = 0) -> list[list[int]]:
    step = (len(held_stream) - length) // max(n, 1)
    return [[bos] + held_stream[i * step + 7:i * step + 7 + length].tolist() for i in range(n)]


def speculative_report(model, prompts: list[list[int]], max_new: int) -> dict:
    """DSpark vs plain greedy on each prompt (alternating, so machine load hits both alike)."""
    drafter = DSparkDrafter(model)
    plain_generate(model, prompts[0], 4)  # warm-up: the ops backend dequantizes weights on first use
    spec_generate(model, drafter, prompts[0], 8)
    accepted, spec_s, plain_s, n_tok, same, conf = [], 0.0, 0.0, 0, 0, []
    samples = []
    for p in prompts:
        g_plain, tp = plain_generate(model, p, max_new)
        g_spec, acc, ts, c = spec_generate(model, drafter, p, max_new)
        accepted += acc
        conf.append(c)
        spec_s += ts
        plain_s += tp
        n_tok += max_new - 1  # both time the tokens after the first (which comes from the prefill)
        same += g_spec == g_plain
        samples.append((p, g_spec))
    rep = acceptance_stats(accepted, drafter.B)
    rep.update(prompts=len(prompts), new_tokens=max_new, greedy_identical=f"{same}/{len(prompts)}",
               plain_tok_s=round(n_tok / plain_s, 2), dspark_tok_s=round(n_tok / spec_s, 2),
               speedup=round(plain_s / spec_s, 3),
               mean_confidence=[round(v, 3) for v in torch.tensor(conf).mean(0).tolist()])
    return rep, samples


# ---- the full report and the model card ----------------------------------------------------------
def evaluate(out: Path, masters, cfg, hasher, train_model, train_stream, held_stream, args) -> dict:
    from v4flash_backend import ops
    from v4flash_backend.model.loading import load_model

    from .loop import heldout_batch

    rep: dict = {}
    held = heldout_batch(held_stream, 16, args.seq)
    rep["heldout_tokens_scored"] = int(held.shape[0] * (held.shape[1] - 1))
    ops.set_backend("torch")
    ops.set_numerics("exact")  # the serving default
    model = load_model(out)
    nll_q = mean_nll(model, held)
    nll_uni = unigram_nll(train_stream, held, cfg.vocab_size)
    rep["heldout"] = {name: {"nll": round(v, 4), "ppl": round(math.exp(v), 2)} for name, v in
                      (("exported", nll_q), ("unigram", nll_uni))}
    prompts = heldout_prompts(held_stream, args.eval_prompts, 32)
    spec, samples = speculative_report(model, prompts, args.eval_tokens)
    rep["dspark"] = spec
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    rep["samples"] = [{"prompt": tok.decode(p[1:]), "continuation": tok.decode(g)} for p, g in samples[:3]]
    return rep


def _size(path: Path) -> str:
    return f"{path.stat().st_size / 2**20:.2f} MiB"


def write_card(out: Path, cfg, tensors: dict, rep: dict) -> None:
    """MODEL_CARD.md from the evaluation report (every number here is measured by the build)."""
    b = rep["build"]
    n_params = sum(t.numel() * (2 if t.dtype == torch.int8 and ".experts." in n else 1)
                   for n, t in tensors.items() if not n.endswith(".scale"))
    n_mtp = sum(t.numel() * (2 if t.dtype == torch.int8 and ".experts." in n else 1)
                for n, t in tensors.items() if n.startswith("mtp.") and not n.endswith(".scale"))
    h, d = rep["heldout"], rep["dspark"]
    roles = layer_roles(cfg)
    lines = [
        "# v4flash-tiny: the embedded default model",
        "",
        "A genuine (small) language model of the DeepSeek-V4.1-Flash architecture, trained on CPU by this repository "
        "from the Python standard library's own source files, so that `make serve` streams real text and DSpark "
        "drafts get accepted without downloading the 475 GiB release. It is a development model: expect "
        "Python-looking text, not correct programs.",
        "",
        "## Reproduce",
        "",
        "```",
        "python -m v4flash_backend.training --out models/v4flash-tiny   # seed " + str(b["seed"]),
        "```",
        "",
        f"Built with Python {b['python']} (its stdlib is the corpus), torch {b['torch']}, {b['threads']} threads: "
        f"target {b.get('target_train_s', '-')} s, DSpark data {b['dspark_data_s']} s, DSpark training "
        f"{b['dspark_train_s']} s, total {b['train_total_s']} s wall clock (shared machine). The same Python "
        "version, torch version and thread count give the same files; another Python release changes the corpus "
        f"(train digest `{b['train_digest'][:16]}`).",
        "",
        "## Size and layout",
        "",
        f"- {n_params / 1e6:.2f} M parameters ({n_mtp / 1e6:.2f} M in the 3 DSpark stages); "
        f"`model.safetensors` {_size(out / 'model.safetensors')}, official V4.1 layout and storage formats: "
        "dense projections fp8 e4m3 with 32x32 e8m0 scales, routed experts MXFP4 (I8-packed, e8m0 per 32), "
        "Engram tables fp8 with e8m0 per 32 columns, norms/embedding/head/router/Markov/confidence bf16, "
        "mHC/sinks/router biases f32.",
        f"- vocab {cfg.vocab_size} (byte-level BPE, `tokenizer.json`: BOS 0, EOS 1, PAD 2, image "
        f"{cfg.image_token_id}, DSpark noise {cfg.dspark_noise_token_id}), dim {cfg.dim}, {cfg.n_layers} layers, "
        f"{cfg.n_heads} heads x {cfg.head_dim} (rope {cfg.rope_head_dim}), q_lora {cfg.q_lora_rank}, "
        f"o_groups {cfg.o_groups} x {cfg.o_lora_rank}, window {cfg.window_size}, index top-k {cfg.index_topk} "
        f"({cfg.index_n_heads} heads x {cfg.index_head_dim}), candidate blocks {cfg.candidate_topk_blocks} x "
        f"{cfg.candidate_block_size}, MoE {cfg.n_routed_experts} experts top-{cfg.n_activated_experts} + "
        f"{cfg.n_shared_experts} shared (inter {cfg.moe_inter_dim}), mHC x{cfg.hc_mult}, Engram "
        f"{cfg.engram_n_heads} heads x {cfg.engram_head_dim}, rows {list(cfg.engram_num_embeddings)}; DSpark block "
        f"{cfg.dspark_block_size}, taps {list(cfg.dspark_target_layer_ids)}, Markov rank {cfg.dspark_markov_rank}, "
        f"{cfg.dspark_n_routed_experts} experts top-{cfg.dspark_n_activated_experts}.",
        "",
        "| layer | compress ratio | role |",
        "|---|---|---|",
        *[f"| {n} | {r} | {role} |" for n, r, role in roles],
        "",
        "## Corpus and training",
        "",
        f"- Corpus: `.py` files of the interpreter's standard library (PSF licence), tests, codec tables and generated "
        f"data modules excluded; split by a hash of each file's path: {b['train_files']} train files "
        f"({b['train_tokens']} tokens), {b['heldout_files']} held-out files ({b['heldout_tokens']} tokens).",
        f"- Target: {b['args']['target_steps']} AdamW steps of {b['args']['batch']} x {b['args']['seq']} tokens "
        f"(lr {b['args']['lr']}, warmup + cosine), through the inference forward itself with fp32 master weights "
        "and fake quantization at every storage point (straight-through gradients); routing biases balanced "
        "without an auxiliary loss; the indexer keeps its random init (its top-k passes no gradient).",
        f"- DSpark: {b['args']['gen_prompts']} greedy continuations ({b['args']['gen_tokens']} tokens) of train-split "
        f"prompts by the exported target, then {b['args']['dspark_steps']} steps on anchors in the generated part: "
        "cross-entropy of the Markov-corrected logits against the target's greedy token plus the soft "
        "cross-entropy to its top-32 distribution (slot weight exp(-k/4)), and the confidence head fit to "
        "1 - 0.5 |p_draft - p_target|_1. The target (embedding and head included) is frozen.",
        "",
        "## Results (measured by the build)",
        "",
        f"Held-out perplexity on {rep['heldout_tokens_scored']} tokens (16 sequences of {b['args']['seq']}):",
        "",
        "| model | loss (nats/token) | perplexity |",
        "|---|---|---|",
        f"| exported checkpoint (fp8/fp4, served numerics) | {h['exported']['nll']} | {h['exported']['ppl']} |",
        f"| unigram baseline (train-split frequencies) | {h['unigram']['nll']} | {h['unigram']['ppl']} |",
        "",
        f"DSpark at temperature 0, batch 1, {d['prompts']} held-out prompts x {d['new_tokens']} new tokens, "
        f"all {cfg.dspark_block_size} drafts verified every step ({d['verify_steps']} verify steps):",
        "",
        f"- mean accepted drafts per verify step {d['mean_accepted']}, tau (accepted + bonus) {d['tau']}",
        f"- acceptance of draft k given drafts < k accepted: {d['accept_conditional']}",
        f"- P(at least k accepted): {d['accept_survival']}; mean confidence per position: {d['mean_confidence']}",
        f"- greedy output identical to plain decoding: {d['greedy_identical']} prompts",
        "- speed: measured by perf/bench_dspark.py (interleaved rounds, held-out prompts; README), not by the build",
        "",
        "## Samples (greedy, held-out prompts)",
        "",
    ]
    for s in rep["samples"]:
        lines += ["```python", s["prompt"] + "⟨⟩" + s["continuation"], "```", ""]
    (out / "MODEL_CARD.md").write_text("\n".join(lines))


def layer_roles(cfg) -> list[tuple[str, int, str]]:
    out = []
    for i in range(cfg.n_total_layers):
        if i >= cfg.n_layers:
            k = i - cfg.n_layers
            out.append((f"mtp.{k}", 0, "DSpark stage" + (" (main_proj)" if k == 0 else "") +
                        (" (Markov + confidence heads)" if k == cfg.n_mtp_layers - 1 else "")))
            continue
        r = cfg.compress_ratios[i]
        parts = []
        if i in cfg.engram_layer_ids:
            parts.append("Engram")
        if not r:
            parts.append("window only")
        elif i in cfg.kv_source_layers:
            parts.append(f"ratio-{r} KV source")
        else:
            parts.append(f"ratio-{r} consumer of layer {cfg.kv_source_of(i)}")
        if i in cfg.index_source_layers:
            parts.append("index source" + (" (candidates)" if 0 <= cfg.candidate_source_layer < i else ""))
        if i == cfg.candidate_source_layer:
            parts.append("candidate source")
        if i in cfg.dspark_target_layer_ids:
            parts.append("DSpark tap")
        out.append((f"layers.{i}", r, ", ".join(parts)))
    return out
