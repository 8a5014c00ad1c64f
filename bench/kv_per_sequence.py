"""KV bytes one sequence holds on a sliding-window model against the full-attention equivalent, prompts a multiple
of the window: measured in sage's pool, from sage's KV-group accounting (`sage config show`), and the model's own
ratio, side by side.

    python bench/kv_per_sequence.py --json out/kv_per_sequence.json
    python bench/kv_per_sequence.py --models gemma3-shape-small --windows 4

Method
  Models     bench/vllm_models.py's sliding-window shapes (random weights, built once into --model-cache), and each
             one's full-attention twin: the same weights with every layer full attention (`layer_types`), so its KV
             is the plain one-table layout.
  Request    one prompt of `--windows` x the model's largest window in random token ids, `--max-tokens` greedy
             tokens, alone in the engine (fp32, one torch thread); after every engine step the pool's blocks in use
             (reference count > 0, less the null block the KV groups hold for ever: blocks a sliding group has let
             go of stay cached, not held) x the pool's block bytes; the peak is the sequence's KV between steps
             (during a step a prefill chunk's new blocks are held too).
  Accounted  `sage_infer.models.kv_group_report` at the final length (prompt + output): the blocks its KV groups
             keep, the bytes every layer keeping every token would take, and the model's own ratio: the share of
             (layer, token) pairs the layers' windows keep.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.engine_vs_vllm import DEFAULT_CACHE  # noqa: E402
from bench.vllm_models import MODELS, prepare_model  # noqa: E402

SLIDING_MODELS = ("gemma3-shape-small", "gpt-oss-shape-small")


def full_attention_twin(model_dir: Path, root: Path) -> Path:
    """A copy of `model_dir` (weights linked) whose config.json makes every layer full attention."""
    twin = root / f"{model_dir.name}-full"
    twin.mkdir()
    for item in model_dir.iterdir():
        if item.name != "config.json":
            (twin / item.name).symlink_to(item)
    config = json.loads((model_dir / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (twin / "config.json").write_text(json.dumps(config))
    return twin


def accounted(model_dir: Path, tokens: int) -> dict:
    """sage's per-group KV accounting for one sequence of `tokens` tokens, and the model's own ratio."""
    from sage_infer.config.serve import ServeConfig
    from sage_infer.models.kv_group_report import kv_group_rows
    from sage_infer.models.loader import arch_config

    config = ServeConfig.model_validate({"model": {"path": str(model_dir), "max_model_len": tokens,
                                                   "dtype": "fp32"}})
    _, groups, sequence = kv_group_rows(config)
    windows = arch_config(model_dir).layer_windows or (None,)
    kept = sum(tokens if w is None else min(w, tokens) for w in windows)
    full = sequence["full_attention_bytes"]
    return {"groups": len(groups), "bytes": sequence["bytes"], "full_attention_bytes": full,
            "ratio": sequence["bytes"] / full, "model_ratio": kept / (len(windows) * tokens)}


def peak_kv_bytes(model_dir: Path, prompt: list[int], max_tokens: int) -> int:
    """The most KV bytes the pool holds for `prompt` run alone, sampled after every engine step."""
    from sage_infer import LLM, SamplingParams
    from sage_infer.config.serve import ServeConfig

    config = {"model": {"path": str(model_dir), "dtype": "fp32"}, "kv_pool": {"num_blocks": 2048},
              "scheduler": {"max_num_seqs": 1}}
    engine = LLM(config=ServeConfig.model_validate(config)).engine
    manager = engine.kv.block_manager
    idle = manager.num_used_blocks  # the KV groups' null block, held for ever
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, manager.num_used_blocks - idle)
    return peak * engine.runner.pool.block_nbytes


def measure(name: str, args, root: Path) -> dict:
    model_dir = prepare_model(MODELS[name], args.model_cache, args.seed)
    config = json.loads((model_dir / "config.json").read_text())
    window = config["sliding_window"]
    prompt_len = args.windows * window
    rng = random.Random(args.seed)
    prompt = [rng.randrange(3, config["vocab_size"]) for _ in range(prompt_len)]
    hybrid = peak_kv_bytes(model_dir, prompt, args.max_tokens)
    full = peak_kv_bytes(full_attention_twin(model_dir, root), prompt, args.max_tokens)
    return {"model": name, "architecture": config["architectures"][0], "window": window,
            "layers": config["num_hidden_layers"], "prompt_tokens": prompt_len, "max_tokens": args.max_tokens,
            "measured_bytes": hybrid, "measured_full_attention_bytes": full, "measured_ratio": hybrid / full,
            "accounted": accounted(model_dir, prompt_len + args.max_tokens)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--models", default=",".join(SLIDING_MODELS), help="comma-separated, from bench/vllm_models.py")
    parser.add_argument("--windows", type=int, default=4, help="prompt length in windows")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE, help="where built models are kept")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    names = args.models.split(",")
    if unknown := [n for n in names if n not in MODELS or "sliding_window" not in MODELS[n].shape]:
        parser.error(f"not a sliding-window model: {unknown}; choose from {','.join(SLIDING_MODELS)}")
    import torch

    torch.set_num_threads(1)
    args.model_cache.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kv_per_sequence_"))
    try:
        rows = [measure(name, args, root) for name in names]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'model':<22} {'window':>6} {'tokens':>11} {'KV MiB':>7} {'full MiB':>9} {'measured':>9} "
          f"{'accounted':>10} {'model own':>10}")
    for r in rows:
        a = r["accounted"]
        print(f"{r['model']:<22} {r['window']:>6} {r['prompt_tokens']:>6}+{r['max_tokens']:<4} "
              f"{r['measured_bytes'] / 2**20:>7.2f} {r['measured_full_attention_bytes'] / 2**20:>9.2f} "
              f"{r['measured_ratio']:>9.3f} {a['ratio']:>10.3f} {a['model_ratio']:>10.3f}")
    write_json(args.json, {"machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
                           "args": {k: str(v) for k, v in vars(args).items() if k != "json"}, "models": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
