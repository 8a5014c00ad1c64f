"""Mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, OLMoE) made by
transformers: sage's greedy tokens equal transformers' `generate` for a batch of prompts of different lengths
with prefix caching on; the engine declines the dense-only C++ decode step and says why; /metrics counts the
tokens routed to each expert of each sparse layer; W8A16 / W4A16 experts run."""

from __future__ import annotations

import json
import random
import re
import shutil

import httpx
import openai
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from sage_infer import LLM, SamplingParams
from sage_infer.backends.offline import llm_config
from sage_infer.layers.linear import packing_unavailable
from sage_infer.layers.moe_grouped import GroupedExpertWeights
from sage_infer.quantization.compressed_tensors import encode_weight, quantization_config
from sage_infer.quantization.weights import WeightScheme, quantize_rtn
from tests.packed_layout import packed_bf16_layout
from tests.server_fixture import running_server
from tests.tiny_models import save_tokenizer

MAX_NEW = 8
NEAR_TIE = 1e-4
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
TOP_K = 2
# family -> (config class, model class, its MoE fields); two layers, one dense in each Qwen family by its own rule
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       decoder_sparse_step=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",  # a window shorter than the prompts: it decides tokens
                dict(num_local_experts=4, intermediate_size=48, sliding_window=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, intermediate_size=32, clip_qkv=1.5)),
}
SPARSE_LAYERS = {"qwen3_moe": [0], "qwen2_moe": [1], "mixtral": [0, 1], "olmoe": [0, 1]}


def make_tiny_moe(directory, family: str, seed: int = 0):
    """A random `family` checkpoint (2 layers, top-2) saved with a tokenizer; the transformers model. Routers and
    experts get weights large enough that the routing and the experts' outputs decide the greedy tokens."""
    config_cls, model_cls, fields = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{
        **dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2,
               tie_word_embeddings=False, num_experts_per_tok=TOP_K), **fields})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." in name and "norm" not in name:
                param.normal_(0, 0.15)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    save_tokenizer(directory, 512)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny_moe(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / "model"
    return request.param, directory, make_tiny_moe(directory, request.param)


def prompts_with_a_shared_prefix(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(5, 500) for _ in range(32)]  # two full 16-token blocks
    return [system + [rng.randrange(5, 500) for _ in range(n)] for n in (1, 7, 20, 3)]


def hf_greedy(hf, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens for each prompt alone, with its logits at each step."""
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=2, output_scores=True, return_dict_in_generate=True)
        expected.append((out.sequences[0, len(prompt):].tolist(), torch.stack(out.scores)[:, 0]))
    return expected


def assert_same_as_hf(expected: list[tuple[list[int], torch.Tensor]], outputs) -> None:
    """Token for token, except after a near-tie in transformers' own logits (then the rest may differ)."""
    for (want, scores), output in zip(expected, outputs):
        got = output.outputs[0].token_ids
        assert len(got) == MAX_NEW
        for pos, (a, b) in enumerate(zip(got, want)):
            if a != b:
                top2 = scores[pos].topk(2).values
                assert float(top2[0] - top2[1]) < NEAR_TIE, f"token {pos}: {got} vs transformers' {want}"
                break


def test_greedy_tokens_match_transformers_with_prefix_hits(tiny_moe):
    family, directory, hf = tiny_moe
    llm = LLM(str(directory), dtype="fp32", num_blocks=64)
    prompts = prompts_with_a_shared_prefix()
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)  # one batch of three lengths, the shared blocks from the cache
    assert all(o.metrics.num_cached_tokens == 32 for o in rest)
    assert_same_as_hf(hf_greedy(hf, prompts), first + rest)
    decided = {d.field: d for d in llm.engine.decisions}
    # its decode steps (3 rows) in the C++ step, experts (and Qwen2-MoE's shared one, OLMoE's q/k norms over all
    # heads and its clamp) and all
    assert decided["model.decode_step"].value == "sage", decided["model.decode_step"].reason
    assert "steps of up to 8 rows" in decided["model.decode_step"].reason
    assert decided["model.experts"].value.endswith(f"top {TOP_K}")
    assert f"{len(SPARSE_LAYERS[family])} of 2 layers sparse" in decided["model.experts"].reason
    load = llm.engine.runner.model.expert_tokens()
    assert [layer for layer, _ in load] == SPARSE_LAYERS[family]
    computed = sum(len(p) - o.metrics.num_cached_tokens + MAX_NEW - 1 for p, o in zip(prompts, first + rest))
    assert all(sum(counts) == computed * TOP_K for _, counts in load)


def test_reference_path_and_deterministic_steps_match_transformers(tmp_path):
    """model.linear / elementwise / attention torch: the stacked experts' PyTorch products; chunked prefill mixes
    prefill and decode rows in a step. Then model.deterministic: every expert its own row-tiled linears."""
    hf = make_tiny_moe(tmp_path, "qwen2_moe")
    prompts = prompts_with_a_shared_prefix(seed=3)[1:]
    expected = hf_greedy(hf, prompts)
    base = llm_config(str(tmp_path), dtype="fp32", num_blocks=64, max_num_batched_tokens=16)
    for fields in (dict(linear="torch", elementwise="torch", attention="torch", prefill_attention="torch"),
                   dict(deterministic=True)):
        llm = LLM(config=base.model_copy(update={"model": base.model.model_copy(update=fields)}))
        assert_same_as_hf(expected, llm.generate(prompts, GREEDY))
    assert {d.field: d.value for d in llm.engine.decisions}["model.deterministic"] == "on"


def test_metrics_count_tokens_per_expert_per_layer(tmp_path):
    make_tiny_moe(tmp_path / "model", "qwen3_moe")
    with running_server(tmp_path / "model") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        computed = 0
        for prompt in ([7, 8, 9, 10, 11], list(range(40, 63))):
            done = client.completions.create(model=server.model, prompt=prompt, max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
            computed += done.usage.prompt_tokens + done.usage.completion_tokens - 1
        families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
        samples = [s for f in families if f.name == "sage:moe_expert_tokens" for s in f.samples
                   if s.name.endswith("_total")]
    per_layer: dict[str, list[float]] = {}
    for sample in samples:
        per_layer.setdefault(sample.labels["layer"], []).append(sample.value)
    assert sorted(per_layer) == ["0"]  # layer 1 is in mlp_only_layers: dense
    assert all(len(counts) == 8 and sum(counts) == computed * TOP_K for counts in per_layer.values())


QUANTIZED = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj|"
                       r"block_sparse_moe\.experts\.\d+\.w[123])\.weight$")


@pytest.mark.parametrize(("family", "scheme"), [("qwen3_moe", WeightScheme(8)), ("mixtral", WeightScheme(4, 16))])
def test_quantized_experts_match_transformers_on_their_dequantized_weights(tmp_path, family, scheme):
    """Every expert (and attention) linear stored W8A16 / W4A16 as compressed-tensors writes it: sage's tokens
    equal transformers' on a float checkpoint of the same weights dequantized."""
    make_tiny_moe(tmp_path / "float", family)
    tensors = load_file(str(tmp_path / "float" / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if QUANTIZED.search(name) is None:
            quantized[name] = dequantized[name] = tensor
            continue
        qw = quantize_rtn(tensor, scheme)
        quantized.update({f"{name.removesuffix('.weight')}.{k}": v.contiguous() for k, v in encode_weight(qw).items()})
        dequantized[name] = qw.dequantize(tensor.dtype).contiguous()
    assert any(".experts.1." in name and name.endswith("weight_packed") for name in quantized)
    shutil.copytree(tmp_path / "float", tmp_path / "quantized")
    save_file(dequantized, str(tmp_path / "float" / "model.safetensors"))
    save_file(quantized, str(tmp_path / "quantized" / "model.safetensors"))
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    (tmp_path / "quantized" / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32).eval()
    prompts = prompts_with_a_shared_prefix(seed=5)[:2]
    llm = LLM(str(tmp_path / "quantized"), dtype="fp32", num_blocks=64)
    assert_same_as_hf(hf_greedy(hf, prompts), llm.generate(prompts, GREEDY))
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert type(experts.get_submodule("1.down_proj")).__name__ != "Linear"  # a quantized layer, not a float one


class RowsOfEachStep:
    """The C++ step of a model, noting each step's rows."""

    def __init__(self, step, rows: list[int]) -> None:
        self.step, self.rows = step, rows

    def run(self, h, *args):
        self.rows.append(h.shape[0])
        return self.step.run(h, *args)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_the_cpp_decode_step_gives_the_layer_loops_tokens_and_expert_counts(tmp_path, family, dtype, monkeypatch):
    """`model.decode_step: sage`: decode steps of up to `decode_step_rows` rows run each sparse layer's routing and
    experts in one kernel call inside the C++ step (the layer loop's op on the same values: the same tokens and
    per-expert counts, in bf16 too), Qwen2-MoE's shared expert and its sigmoid gate beside it, OLMoE's q/k norms
    over all heads and its clamp of q, k and v before the rotary. Where the router is
    packed and the experts past the kernel's limit have their own oneDNN weights (`decode_step_rows_args`: bf16 in
    oneDNN's AMX layout), steps of any rows run there as the layer loop runs them (the router's product and
    PyTorch's top-k past 8 rows, the busy experts on their own weights past the limit); else a step of more rows
    runs layer by layer."""
    if dtype == "bf16" and packing_unavailable(torch.bfloat16) is None and packed_bf16_layout() is not None:
        pytest.skip(f"bf16 experts are packed by oneDNN, not on the grouped kernel: {packed_bf16_layout()}")
    make_tiny_moe(tmp_path, family)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (3, 9, 20, 33, 5, 12, 7, 18, 26, 4, 11)]
    many = [[rng.randrange(5, 500) for _ in range(rng.randrange(3, 30))] for _ in range(32)]
    base = llm_config(str(tmp_path), dtype=dtype, num_blocks=160)
    results = {}
    past_limit = []
    real = GroupedExpertWeights.routed_with_linears
    monkeypatch.setattr(GroupedExpertWeights, "routed_with_linears",
                        lambda self, x, *a: past_limit.append(x.shape[0]) or real(self, x, *a))
    for choice in ("sage", "python"):
        llm = LLM(config=base.model_copy(update={"model": base.model.model_copy(update={"decode_step": choice})}))
        runner = llm.engine.runner
        calls = []
        sparse = [layer.mlp for layer in runner.model.model.layers if hasattr(layer.mlp, "decode_step_rows_args")]
        any_rows = all(mlp.decode_step_rows_args() is not None for mlp in sparse)
        if choice == "sage":
            runner.step.handle = RowsOfEachStep(runner.step.handle, calls)
            assert runner.step.max_rows == (None if any_rows else 8)
        small = llm.generate(prompts[:4], GREEDY)  # 4 rows a decode step: in C++
        large = llm.generate(prompts, GREEDY)  # 11 rows a decode step: in C++ where it takes any rows
        larger = llm.generate(many, GREEDY)  # 32: some experts past the kernel's limit where it has one
        results[choice] = ([o.outputs[0].token_ids for o in small + large + larger], runner.model.expert_tokens(),
                           calls)
    (tokens, counts, calls), (want_tokens, want_counts, _) = results["sage"], results["python"]
    assert tokens == want_tokens
    assert counts == want_counts
    # the 4-row steps in C++, and the 11- and 32-row ones where it takes any rows
    assert calls and max(calls) == (32 if any_rows else 4)
    if any_rows and any(mlp.decode_step_rows_args()[2] >= 0 for mlp in sparse):  # the layer loop went past the limit
        assert 32 in past_limit
