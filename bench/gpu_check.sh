#!/usr/bin/env bash
# The GPU checks for an NVIDIA machine, as one script (each step time-boxed, every log under $OUT): the Triton
# kernels' (attention, its kinds, the grouped MoE experts), CUDA graphs' and speculative decoding's tests on CUDA,
# speculative decoding against none (bench/spec_decode.py), the kernel against the PyTorch path
# (bench/paged_decode_kernel.py --device cuda), the Triton MoE experts against the per-expert loop
# (bench/triton_moe.py), the engine's decode attention A/B on the 0.5B shape, and a tier hit loaded into the GPU's
# pool against recomputing it (bench/load_vs_recompute.py --device cuda).
#
#   OUT=out/gpu bash bench/gpu_check.sh            # on the GPU machine, from the repository root
#   STEPS="tests spec" OUT=out/gpu bash bench/gpu_check.sh   # some of: tests kvtests spec spec05 kernel moe engine
#                                                            # prefill profile kvcopy tiers hf hf05
#   LIMIT_tests=200 WORKLOADS=W3 STEPS="tests engine" ...    # a step's time limit (seconds), the engine's workloads
#   TIERS_REPEATS=5 STEPS=tiers ...                          # repeats per length of the tier-hit bench (3)
#
# Python packages the machine's image lacks are installed from wheels in .whl/ when that folder exists
# (pip download ... -d .whl, see docs/benchmarks.md, "Triton paged decode attention on a GPU").
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{
    nvidia-smi -L
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
    # the CPU kernels (the tiers' copy + checksum, host-side steps): which build loads here, or why none does
    python3 -c "from sage_infer.layers import cpu_kernels as k; print('cpu kernels:', k.kernel_level() or k.kernel_unavailable())"
} 2>&1 | tee "$OUT/versions.txt"

step() {  # step NAME SECONDS COMMAND...: one check, its log in $OUT/NAME.log, its exit code noted
    local name=$1 limit_var="LIMIT_$1"
    local limit=${!limit_var:-$2}  # LIMIT_<name>=SECONDS overrides a step's limit (a lease's time is short)
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc"
    tail -n 25 "$OUT/$name.log"
}

STEPS=${STEPS:-tests spec spec05 kernel moe engine prefill profile kvcopy tiers hf hf05}
case " $STEPS " in *" tests "*)
    step tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_triton_paged.py tests/test_triton_kinds.py \
        tests/test_triton_moe.py tests/test_cuda_graphs.py tests/test_spec_decode.py tests/test_kv_tiers_cuda.py \
        tests/test_layer_loads.py ;; esac
case " $STEPS " in *" kvtests "*)  # only the KV loads into the GPU's pool (tiers, whole and layer by layer)
    step kvtests 150 python3 -m pytest -q -p no:cacheprovider tests/test_kv_tiers_cuda.py tests/test_layer_loads.py
    ;; esac
case " $STEPS " in *" spec "*)  # n-gram speculation against none, the demo model in bf16 on the GPU
    step spec 120 python3 bench/spec_decode.py --device cuda --dtype bf16 --batch 1 8 --k 4 \
        --json "$OUT/spec_decode_cuda.json" ;; esac
case " $STEPS " in *" spec05 "*)  # the same on the 0.5B shape (random weights: random-token prompts)
    model=$(python3 -c "from pathlib import Path; from bench.vllm_models import MODELS, prepare_model
print(prepare_model(MODELS['qwen2.5-0.5b-shape'], Path('/tmp/sage-models')))") || exit 1
    step spec05 150 python3 bench/spec_decode.py --device cuda --dtype bf16 --model "$model" --batch 1 8 --k 4 \
        --json "$OUT/spec_decode_cuda_05b.json" ;; esac
case " $STEPS " in *" kernel "*)
    step kernel 120 python3 bench/paged_decode_kernel.py --device cuda --json "$OUT/paged_decode_kernel_cuda.json" ;;
esac
case " $STEPS " in *" moe "*)  # the Triton grouped experts against one product per expert, Qwen3-30B-A3B's layer, bf16
    step moe 120 python3 bench/triton_moe.py --json "$OUT/triton_moe_cuda.json"
    rm -f "$OUT/moe.log" ;;  # its tail is above
esac
case " $STEPS " in *" engine "*)
    for workload in ${WORKLOADS:-W3 W1 W2}; do
        step "engine_$workload" 150 python3 bench/engine_ab.py --model qwen2.5-0.5b-shape --dtype bf16 --device cuda \
            --workload "$workload" --repeats 2 --kv-gib 8 --model-cache /tmp/sage-models \
            --variant torch model.attention=torch --variant triton model.attention=paged model.cuda_graphs=off \
            --variant graphs model.attention=paged model.cuda_graphs=on \
            --json "$OUT/engine_ab_cuda_$workload.json"
    done ;;
esac
case " $STEPS " in *" prefill "*)  # the Triton prefill kernel against span-by-span PyTorch prefill, graphs on in both
    for workload in ${PREFILL_WORKLOADS:-W1 W2 W4}; do
        step "prefill_$workload" 150 python3 bench/engine_ab.py --model qwen2.5-0.5b-shape --dtype bf16 --device cuda \
            --workload "$workload" --repeats 2 --kv-gib 8 --model-cache /tmp/sage-models \
            --variant torch model.prefill_attention=torch --variant sage model.prefill_attention=sage \
            --json "$OUT/engine_ab_cuda_prefill_$workload.json"
        rm -f "$OUT/prefill_$workload.log"  # its tail is above; at most 8 files come back from a device call
    done ;;
esac
case " $STEPS " in *" profile "*)  # where a GPU step's host time goes (the engine's ops are launched from Python)
    for workload in ${PROFILE_WORKLOADS:-W3 W1}; do
        step "profile_$workload" 120 python3 bench/profile_engine_step.py --model qwen2.5-0.5b-shape --dtype bf16 \
            --device cuda --workload "$workload" --profile-steps 2 --ops 25 --model-cache /tmp/sage-models \
            --json "$OUT/profile_cuda_$workload.json"
    done ;;
esac
case " $STEPS " in *" kvcopy "*)  # the layer-wise Triton copy from page-locked rows against one host-to-device copy
    step kvcopy 90 python3 bench/layer_copy.py --json "$OUT/layer_copy_cuda.json" ;; esac
case " $STEPS " in *" tiers "*)  # a host / disk tier hit loaded into the GPU's pool against recomputing it
    step tiers 200 python3 bench/load_vs_recompute.py --device cuda --model qwen2.5-0.5b-shape --dtype bf16 \
        --lengths 256,1024,4096,16384 --tiers host,disk --repeats ${TIERS_REPEATS:-3} --settle-s 0.2 --cache-dir /tmp/sage-models \
        --json "$OUT/load_vs_recompute_cuda.json" ;;
esac
case " $STEPS " in *" hf "*)  # sage against transformers on the same GPU
    step hf 200 python3 bench/engine_vs_hf.py --device cuda --dtype bf16 --threads 4 --repeats 2 \
        --json "$OUT/engine_vs_hf_cuda.json" ;;
esac
case " $STEPS " in *" hf05 "*)  # the same on the 0.5B shape (362M, bf16), which a GPU step no longer hides in launch latency
    model=$(python3 -c "from pathlib import Path; from bench.vllm_models import MODELS, prepare_model
print(prepare_model(MODELS['qwen2.5-0.5b-shape'], Path('/tmp/sage-models')))") || exit 1
    step hf05 ${HF05_LIMIT:-240} python3 bench/engine_vs_hf.py --device cuda --dtype bf16 --threads 4 --repeats 2 \
        --model "$model" --json "$OUT/engine_vs_hf_cuda_05b.json" ;;
esac
