"""A tied lm_head packed as a copy (`model.linear: packed`, the default) against the head left as an
`nn.Linear` over the embedding's weight (what the engine did before tied heads were packed), on a random
Qwen2.5-0.5B shape with its real vocabulary (151,936, tied, as the released model), bf16.

    python bench/tied_head.py --json out/tied_head.json

The bench models of bench/vllm_models.py carry the demo tokenizer's 4,096-token vocabulary, whose
head is 1 % of the weights; a real small model's head is 27 % of them (Qwen2.5-0.5B: 151,936 x 896).
Prompts are token ids below 4,096 (the demo tokenizer, copied next to the model); each variant builds a
fresh `LLM`, warms it up and times 128 greedy tokens (ignore-EOS) for `--batches` prompts at once; the
variants alternate, `--repeats` times. Output: median tok/s each, the ratio, greedy agreement.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from bench.engine_vs_vllm import DEFAULT_CACHE  # noqa: E402
from bench.vllm_models import ModelSpec, prepare_model  # noqa: E402

SHAPE = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864)
SPEC = ModelSpec("qwen2.5-0.5b-realvocab", "random Qwen2.5-0.5B shape with its 151,936-token vocabulary, tied",
                 "bf16", arch="qwen2", shape=SHAPE)


def build(directory: Path, variant: str):
    from sage_infer import LLM, SamplingParams
    from sage_infer.layers.linear import PackedLinear

    llm = LLM(str(directory), dtype="bf16", kv_memory="1GiB")
    model = llm.engine.runner.model
    assert isinstance(model.lm_head, PackedLinear), "model.linear did not pack the tied head"
    if variant == "unpacked":  # the head reads the embedding's weight through F.linear, as before
        head = torch.nn.Linear(SHAPE["hidden_size"], SHAPE["vocab_size"], bias=False, dtype=torch.bfloat16)
        head.weight = model.model.embed_tokens.weight
        model.lm_head = head
    llm.generate([[5] * 20], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return llm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from sage_infer import SamplingParams

    torch.set_num_threads(args.threads)
    directory = prepare_model(SPEC, args.model_cache)
    batches = [int(b) for b in args.batches.split(",")]
    rates: dict[str, dict[int, list[float]]] = {v: {b: [] for b in batches} for v in ("unpacked", "packed")}
    tokens: dict[tuple[str, int], list] = {}
    for rep in range(args.repeats):
        for batch in batches:
            for variant in (("unpacked", "packed") if rep % 2 == 0 else ("packed", "unpacked")):
                llm = build(directory, variant)
                prompts = [list(range(7 + i, 135 + i)) for i in range(batch)]
                start = time.perf_counter()
                outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
                rates[variant][batch].append(batch * 128 / (time.perf_counter() - start))
                tokens[variant, batch] = [o.outputs[0].token_ids for o in outs]
                rate = rates[variant][batch][-1]
                print(f"  repeat {rep + 1} batch {batch} {variant:<9} {rate:7.1f} tok/s", flush=True)
                del llm
                gc.collect()
    report = {"shape": SHAPE, "threads": args.threads, "repeats": args.repeats, "batches": {}}
    print(f"\ntied lm_head, Qwen2.5-0.5B shape with vocab {SHAPE['vocab_size']}, bf16, {args.threads} threads")
    print(f"{'batch':>5} {'unpacked tok/s':>15} {'packed tok/s':>13} {'packed / unpacked':>18} "
          f"{'greedy identical':>17}")
    for batch in batches:
        a, b = statistics.median(rates["unpacked"][batch]), statistics.median(rates["packed"][batch])
        same = sum(x == y for x, y in zip(tokens["unpacked", batch], tokens["packed", batch]))
        print(f"{batch:>5} {a:15.1f} {b:13.1f} {b / a:17.2f}x {same:>12}/{batch}")
        report["batches"][batch] = {"unpacked_tok_s": rates["unpacked"][batch], "packed_tok_s": rates["packed"][batch],
                                    "ratio_of_medians": b / a, "greedy_identical": same}
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
