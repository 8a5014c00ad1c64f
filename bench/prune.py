"""Held-out perplexity of structured pruning: importance-chosen vs randomly chosen structures.

    python bench/prune.py --json out/prune.json
    python bench/prune.py --model DIR --configs "ffn=25%;heads=2;ffn=25%,heads=2"
    python bench/prune.py --head-study 2      # per layer: every choice of 2 KV groups, masked


For each configuration, `sage compress prune` (calibrated on the Shakespeare train split) and a
pruned copy of the same sizes whose channels / KV groups are drawn at random are evaluated on
the held-out split (the demo model's validation windows: 48 x 256 tokens by default), next to
the unpruned model. Perplexity is exp(mean next-token NLL) with `transformers` in fp32.

`--head-study N` instead asks how good the KV-group score is within one layer: for each layer
alone, every set of N KV groups is silenced (its o_proj columns zeroed) and the perplexity on
16 calibration windows is printed next to the set's summed score; the score's pick is marked.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
import transformers

from sage_infer.models.loader import DEMO_MODEL_DIR, weight_files
from sage_infer.pruning.checkpoint import LayerKeep, write_pruned
from sage_infer.pruning.importance import AttentionShape, collect_importance_stats, kv_group_scores
from sage_infer.pruning.structured import PruneSpec, prune_checkpoint
from sage_infer.quantization.calibration import calibration_batches, heldout_windows, perplexity


def parse_configs(text: str) -> list[dict]:
    """``"ffn=25%;heads=2;ffn=25%,heads=2"`` -> [{"ffn": "25%"}, {"heads": 2}, {...}]."""
    configs = []
    for item in text.split(";"):
        config = {}
        for pair in item.split(","):
            key, _, value = pair.strip().partition("=")
            config[key] = int(value) if key == "heads" else value
        configs.append(config)
    return configs


def random_copy(src: Path, pruned: Path, out: Path, seed: int) -> None:
    """A copy of `src` with the same sizes as `pruned`, keeping random channels and KV groups."""
    record = json.loads((pruned / "pruning.json").read_text())
    before, after = record["before"], record["after"]
    shape = AttentionShape(len(record["layers"]), before["num_attention_heads"], before["num_key_value_heads"],
                           after["head_dim"])
    rng = random.Random(seed)
    keep = [LayerKeep(sorted(rng.sample(range(before["intermediate_size"]), after["intermediate_size"])),
                      sorted(rng.sample(range(before["num_key_value_heads"]), after["num_key_value_heads"])))
            for _ in record["layers"]]
    write_pruned(src, out, weight_files(src), keep, shape, after, {"method": "random", "seed": seed})


def evaluate(directory: Path, windows: torch.Tensor) -> tuple[float, int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return perplexity(model, windows, batch_size=16), sum(p.numel() for p in model.parameters())


@torch.no_grad()
def head_study(directory: Path, num_groups: int, calib_samples: int, calib_seq_len: int) -> list[dict]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = AttentionShape(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, head_dim)
    batches = calibration_batches(tokenizer, calib_samples, calib_seq_len)
    stats = collect_importance_stats(model, batches, shape, ffn=False, heads=True)
    windows, width = batches[:16], shape.group_size * head_dim
    rows = [{"layer": None, "removed": [], "ppl": perplexity(model, windows, 16), "score": None}]
    print(f"unpruned: calibration ppl {rows[0]['ppl']:.2f}")
    for layer in range(shape.num_layers):
        weight = model.model.layers[layer].self_attn.o_proj.weight
        original, scores = weight.clone(), kv_group_scores(stats, layer)
        pick = sorted(torch.sort(scores, stable=True).indices[:num_groups].tolist())
        for removed in itertools.combinations(range(shape.num_kv_heads), num_groups):
            for g in removed:
                weight[:, g * width:(g + 1) * width] = 0
            rows.append({"layer": layer, "removed": list(removed), "ppl": perplexity(model, windows, 16),
                         "score": float(scores[list(removed)].sum()), "picked": list(removed) == pick})
            weight.copy_(original)
        for r in sorted((r for r in rows if r["layer"] == layer), key=lambda r: r["ppl"]):
            print(f"layer {layer} remove {r['removed']}: ppl {r['ppl']:8.2f} score {r['score']:12.4g}"
                  f"{'  <- score picks this' if r['picked'] else ''}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--configs", default="ffn=25%;ffn=50%;heads=2;ffn=25%,heads=2")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--calib-seq-len", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=48)
    parser.add_argument("--eval-seq-len", type=int, default=256)
    parser.add_argument("--random-seeds", type=int, default=3, help="random-choice copies per configuration")
    parser.add_argument("--head-study", type=int, default=0, metavar="N",
                        help="instead: per layer, silence every set of N KV groups (see above)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    if args.head_study:
        rows = head_study(args.model, args.head_study, args.calib_samples, args.calib_seq_len)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"model": str(args.model), "head_study": rows}, indent=2) + "\n")
        return

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    windows = heldout_windows(tokenizer, args.eval_windows, args.eval_seq_len)
    base_ppl, base_params = evaluate(args.model, windows)
    results = [{"config": "original", "params": base_params, "ppl": base_ppl, "random_ppl": []}]
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(parse_configs(args.configs)):
            pruned = Path(tmp) / f"pruned{i}"
            start = time.perf_counter()
            prune_checkpoint(args.model, pruned, PruneSpec(ffn=config.get("ffn"), heads=config.get("heads", 0),
                                                           calib_samples=args.calib_samples,
                                                           calib_seq_len=args.calib_seq_len))
            prune_s = time.perf_counter() - start
            ppl, params = evaluate(pruned, windows)
            random_ppl = []
            for seed in range(args.random_seeds):
                copy = Path(tmp) / f"random{i}-{seed}"
                random_copy(args.model, pruned, copy, seed)
                random_ppl.append(evaluate(copy, windows)[0])
            name = ",".join(f"{k}={v}" for k, v in config.items())
            results.append({"config": name, "params": params, "ppl": ppl, "random_ppl": random_ppl,
                            "prune_s": round(prune_s, 2)})

    print(f"held-out perplexity, {args.eval_windows} x {args.eval_seq_len} tokens; calibration "
          f"{args.calib_samples} x {args.calib_seq_len} tokens of the train split; {platform.processor() or 'cpu'}, "
          f"{args.threads} threads")
    print(f"{'config':>20} {'params':>10} {'ppl':>8} {'random ppl (median)':>20} {'prune s':>8}")
    for r in results:
        rand = sorted(r["random_ppl"])[len(r["random_ppl"]) // 2] if r["random_ppl"] else None
        print(f"{r['config']:>20} {r['params']:>10,} {r['ppl']:>8.2f} "
              f"{'' if rand is None else f'{rand:.2f}':>20} {r.get('prune_s', ''):>8}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": str(args.model), "calib_samples": args.calib_samples, "calib_seq_len": args.calib_seq_len,
                "eval_windows": args.eval_windows, "eval_seq_len": args.eval_seq_len, "threads": args.threads,
                "torch": torch.__version__, "transformers": transformers.__version__}
        args.json.write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
