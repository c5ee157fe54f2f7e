"""Train the bundled model from nothing: corpus, tokenizer, weights, model card.

    python -m mla_watch.models.train                 # writes mla_watch/models/bundled/
    python -m mla_watch.models.train --steps 50 --out /tmp/m   # a quick smoke run

The run is deterministic for a given seed and thread count (it pins both): the corpus comes
from seeded generators, the tokenizer trainer is deterministic, and torch runs with
deterministic algorithms.

Training follows DeepSeek-V3.2 in miniature:

* language-modelling loss on a packed stream of the four business-line domains;
* DeepSeek-V3's auxiliary-loss-free balancing: after every step each MoE router's
  ``e_score_correction_bias`` moves by ``gamma * sign(mean_load - load_i)`` (gamma = 0.001),
  with the loads read by mla_watch's own probe;
* the DSA indexer is trained as in DeepSeek-V3.2's dense warm-up: the model attends densely
  while the indexer learns, by a KL loss on detached inputs, to score keys the way the main
  attention weighs them; the saved config then makes it choose ``index_topk`` keys.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import DeepseekV32ForCausalLM
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as dsv32

from mla_watch.common.output_file import write_file
from mla_watch.models import corpus
from mla_watch.models.architecture import bundled_config
from mla_watch.models.balance import sign_step
from mla_watch.models.loading import BUNDLED_DIR
from mla_watch.models.loss import next_token_loss
from mla_watch.models.tokenizer import train_tokenizer
from mla_watch.probe import attach
from mla_watch.routing.routers import CORRECTION_BIAS

__all__ = ["TrainSettings", "main", "train"]

GAMMA = 0.001


class TrainSettings:
    def __init__(
        self,
        *,
        steps: int = 1800,
        batch_size: int = 8,
        seq_len: int = 256,
        lr: float = 3e-3,
        warmup: int = 100,
        weight_decay: float = 0.01,
        seed: int = 20260,
        vocab_size: int = 2048,
        train_samples_per_domain: int = 6000,
        heldout_samples_per_domain: int = 150,
        gamma: float = GAMMA,
        indexer_loss_weight: float = 1.0,
        indexer_every: int = 4,
        completion_tokens: int = 80,
        threads: int = 2,
    ) -> None:
        self.steps = steps
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.lr = lr
        self.warmup = warmup
        self.weight_decay = weight_decay
        self.seed = seed
        self.vocab_size = vocab_size
        self.train_samples_per_domain = train_samples_per_domain
        self.heldout_samples_per_domain = heldout_samples_per_domain
        self.gamma = gamma
        self.indexer_loss_weight = indexer_loss_weight
        self.indexer_every = indexer_every
        self.completion_tokens = completion_tokens
        self.threads = threads

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def _seed_everything(seed: int, threads: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def _encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [[bos, *ids, eos] for ids in encoded]


def _pack(sequences: Sequence[list[int]], seq_len: int) -> torch.Tensor:
    stream = [token for sequence in sequences for token in sequence]
    blocks = len(stream) // seq_len
    return torch.tensor(stream[: blocks * seq_len], dtype=torch.int64).view(blocks, seq_len)


def _lr_at(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class _IndexerInputs:
    """Keeps what each indexer was called with, to score keys again with gradients."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: dict[int, tuple] = {}
        self.indexers = [m for m in model.modules() if isinstance(m, dsv32.DeepseekV32Indexer)]
        self.handles = [
            indexer.register_forward_pre_hook(self._keep(i), with_kwargs=True)
            for i, indexer in enumerate(self.indexers)
        ]

    def _keep(self, position: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            self.calls[position] = args

        return hook


def _indexer_scores(
    indexer: Any,
    hidden: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
) -> torch.Tensor:
    """``DeepseekV32Indexer.forward`` up to its scores, with autograd (the original runs without)."""
    batch, seq, _ = hidden.shape
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(batch, seq, indexer.n_heads, indexer.head_dim)
    rope = indexer.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = dsv32.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden) * (indexer.n_heads**-0.5)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if mask.dtype == torch.bool:
        return index_scores.masked_fill(~mask, float("-inf"))
    return index_scores + mask


def _indexer_loss(inputs: _IndexerInputs, attentions: Sequence[torch.Tensor]) -> torch.Tensor:
    losses = []
    for position, indexer in enumerate(inputs.indexers):
        hidden, q_resid, position_embeddings, mask = inputs.calls[position][:4]
        scores = _indexer_scores(
            indexer,
            hidden.detach(),
            q_resid.detach(),
            (position_embeddings[0].detach(), position_embeddings[1].detach()),
            mask,
        )
        target = attentions[indexer.layer_idx].detach().sum(1)
        target = target / target.sum(-1, keepdim=True)
        log_q = torch.log_softmax(scores, dim=-1).clamp(min=-1e4)
        losses.append(F.kl_div(log_q, target, reduction="batchmean") / target.shape[1])
    return torch.stack(losses).mean()


def _rebalance(model: torch.nn.Module, probe: Any, gamma: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free step (:func:`~mla_watch.models.balance.sign_step`) on every router with a
    correction bias."""
    counts = probe.counts()
    probe.reset()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, load in counts.items():
            router = modules[name]
            if not hasattr(router, CORRECTION_BIAS):
                continue
            load_tensor = torch.as_tensor(load, dtype=torch.float32)
            router.e_score_correction_bias += sign_step(load_tensor, gamma)


@torch.no_grad()
def perplexity(model: DeepseekV32ForCausalLM, sequences: Sequence[list[int]], batch_size: int = 16) -> float:
    """Per-token perplexity of ``sequences`` (right-padded batches, padding excluded)."""
    total_loss, total_tokens = 0.0, 0
    pad = model.config.pad_token_id
    assert pad is not None  # bundled_config sets it
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.int64)
        mask = torch.zeros((len(chunk), width), dtype=torch.int64)
        for row, sequence in enumerate(chunk):
            ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
        loss, tokens = next_token_loss(model, ids, mask)
        total_loss += float(loss)
        total_tokens += tokens
    return math.exp(total_loss / max(1, total_tokens))


@torch.no_grad()
def routing_by_domain(model: torch.nn.Module, encoded: dict[str, list[list[int]]]) -> dict[str, dict[str, float]]:
    """Entropy (bits) of every MoE router for each domain and for all domains mixed."""
    probe = attach(model, window_tokens=None)
    try:
        for domain, sequences in encoded.items():
            with probe.attribute(domain):
                for sequence in sequences:
                    model(input_ids=torch.tensor([sequence]))
        result: dict[str, dict[str, float]] = {}
        for line in [None, *encoded]:
            label = "mixed" if line is None else line
            result[label] = {
                record["name"]: round(record["entropy_bits"], 3)
                for record in probe.stats(line)
                if record["kind"] == "expert"
            }
        return result
    finally:
        probe.detach()


@torch.no_grad()
def sample_completions(
    model: DeepseekV32ForCausalLM, tokenizer: Any, seed: int, max_new_tokens: int = 80
) -> dict[str, dict[str, str]]:
    samples = {}
    for domain in corpus.DOMAINS:
        prompt = corpus.prompts(domain, 1, seed + 7)[0]
        ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]])
        output = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        samples[domain] = {
            "prompt": prompt,
            "completion": tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=False),
        }
    return samples


def train(out_dir: Path, settings: TrainSettings, log_every: int = 100) -> dict[str, Any]:
    started = time.perf_counter()
    _seed_everything(settings.seed, settings.threads)
    train_texts = corpus.generate_mixed(settings.train_samples_per_domain * len(corpus.DOMAINS), settings.seed)
    heldout = {d: corpus.generate(d, settings.heldout_samples_per_domain, settings.seed + 1) for d in corpus.DOMAINS}
    tokenizer = train_tokenizer((text for _, text in train_texts), settings.vocab_size)
    stream = _pack(_encode(tokenizer, [text for _, text in train_texts]), settings.seq_len)
    heldout_ids = {d: _encode(tokenizer, texts) for d, texts in heldout.items()}
    print(
        f"corpus: {len(train_texts)} samples, {stream.numel()} training tokens in {stream.shape[0]} blocks; "
        f"vocab {len(tokenizer)}",
        flush=True,
    )

    config = bundled_config(
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    serving_index_topk = config.index_topk
    config._experts_implementation = "grouped_mm"  # the same maths as the eager loop, 2x faster to train
    model = DeepseekV32ForCausalLM(config)
    indexer_inputs = _IndexerInputs(model)
    for indexer in indexer_inputs.indexers:
        indexer.index_topk = settings.seq_len  # dense warm-up: the indexer learns, attention stays dense
    probe = attach(model, window_tokens=None)
    trainable = [p for n, p in model.named_parameters() if ".indexer." not in n]
    indexer_params = [p for n, p in model.named_parameters() if ".indexer." in n]
    optimizer = torch.optim.AdamW(
        [{"params": trainable}, {"params": indexer_params}],
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        betas=(0.9, 0.95),
    )
    order = torch.Generator().manual_seed(settings.seed)
    permutation = torch.randperm(stream.shape[0], generator=order)
    history = []
    model.train()
    cursor = 0
    last_indexer_kl = float("nan")
    for step in range(settings.steps):
        if cursor + settings.batch_size > len(permutation):
            permutation, cursor = torch.randperm(stream.shape[0], generator=order), 0
        batch = stream[permutation[cursor : cursor + settings.batch_size]]
        cursor += settings.batch_size
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, settings)
        train_indexer = step % settings.indexer_every == 0
        output = model(input_ids=batch, labels=batch, output_attentions=train_indexer)
        loss = output.loss
        if train_indexer:
            indexer_loss = _indexer_loss(indexer_inputs, output.attentions)
            loss = loss + settings.indexer_loss_weight * indexer_loss
            last_indexer_kl = float(indexer_loss.detach())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        _rebalance(model, probe, settings.gamma)
        if step % log_every == 0 or step == settings.steps - 1:
            entry = {
                "step": step,
                "lm_loss": round(float(output.loss), 4),
                "indexer_kl": round(last_indexer_kl, 4),
                "seconds": round(time.perf_counter() - started, 1),
            }
            history.append(entry)
            print(json.dumps(entry), flush=True)
    probe.detach()
    for handle in indexer_inputs.handles:
        handle.remove()
    for indexer in indexer_inputs.indexers:
        indexer.index_topk = serving_index_topk
    model.eval()
    train_seconds = time.perf_counter() - started

    report = {
        "settings": settings.as_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(train_seconds, 1),
        "threads": settings.threads,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "final_lm_loss": history[-1]["lm_loss"],
        "history": history,
        "heldout_perplexity": {d: round(perplexity(model, ids), 3) for d, ids in heldout_ids.items()},
        "routing_entropy_bits": routing_by_domain(model, heldout_ids),
        "completions": sample_completions(model, tokenizer, settings.seed, settings.completion_tokens),
    }
    _save(model, tokenizer, out_dir, report)
    return report


def _save(model: Any, tokenizer: Any, out_dir: Path, report: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    write_file(out_dir / "training_report.json", json.dumps(report, indent=1) + "\n")
    write_file(out_dir / "MODEL_CARD.md", model_card(report))


def model_card(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# mla_watch bundled model",
        "",
        "A miniature DeepSeek-V3.2 (`DeepseekV32ForCausalLM`, transformers 5.x) trained by "
        "`python -m mla_watch.models.train` on a corpus mla_watch generates itself "
        "(`mla_watch.models.corpus`) for four business lines. Everything in this card was "
        "measured by that command; `training_report.json` holds the raw figures.",
        "",
        "## Config",
        "",
        f"- {report['parameters']:,} parameters (float32, tied embeddings); vocabulary "
        f"{s['vocab_size']} (byte-level BPE trained with `tokenizers`)",
        "- hidden 128, 4 layers (layer 0 dense, layers 1-3 MoE), 4 attention heads",
        "- MLA: q_lora_rank 64, kv_lora_rank 32 (compressed latent KV), qk_nope 16 + qk_rope 16, v_head 32",
        "- DSA indexer: 4 heads of 32, index_topk 64",
        "- MoE: 64 routed experts, top-6, 1 shared expert, sigmoid scores with `e_score_correction_bias`",
        "",
        "## Training",
        "",
        f"- {s['steps']} steps of {s['batch_size']}x{s['seq_len']} tokens, AdamW lr {s['lr']} "
        f"(warm-up {s['warmup']}, cosine to 10%), seed {s['seed']}, {s['threads']} threads, "
        f"{report['train_seconds']} s on {report['machine']}",
        f"- auxiliary-loss-free balancing with gamma = {s['gamma']}",
        "- indexer: DeepSeek-V3.2 dense warm-up (KL to the main attention, inputs detached)",
        f"- final training LM loss {report['final_lm_loss']}",
        "",
        "## Held-out perplexity (per token)",
        "",
        "| domain | perplexity |",
        "|---|---|",
    ]
    lines += [f"| {d} | {p} |" for d, p in report["heldout_perplexity"].items()]
    routing = report["routing_entropy_bits"]
    routers = list(routing["mixed"])
    lines += [
        "",
        "## Routing entropy per MoE layer (bits; ceiling log2 64 = 6.0, floor log2 6 = 2.585)",
        "",
        "| traffic | " + " | ".join(routers) + " |",
        "|---|" + "---|" * len(routers),
    ]
    lines += [f"| {label} | " + " | ".join(str(v[r]) for r in routers) + " |" for label, v in routing.items()]
    lines += ["", "## Greedy completions of in-domain prompts", ""]
    for domain, sample in report["completions"].items():
        lines += [f"### {domain}", "", "```", sample["prompt"] + sample["completion"], "```", ""]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BUNDLED_DIR)
    parser.add_argument("--steps", type=int, default=TrainSettings().steps)
    parser.add_argument("--seed", type=int, default=TrainSettings().seed)
    parser.add_argument("--samples-per-domain", type=int, default=TrainSettings().train_samples_per_domain)
    parser.add_argument("--log-every", type=int, default=100)
    args = parser.parse_args(argv)
    settings = TrainSettings(steps=args.steps, seed=args.seed, train_samples_per_domain=args.samples_per_domain)
    report = train(args.out, settings, log_every=args.log_every)
    print(json.dumps({k: report[k] for k in ("train_seconds", "heldout_perplexity", "routing_entropy_bits")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
