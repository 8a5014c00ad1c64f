"""`sage llm ...`: generate with a model, or serve it.

`serve` runs the OpenAI-compatible server, `generate` runs prompts offline, `bench`
drives a running server with a workload.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from sage_infer.cli.llm_bench import bench
from sage_infer.cli.options import (
    BackendOpt,
    ConfigFileOpt,
    DeterministicOpt,
    KVCacheDtypeOpt,
    KVTiersOpt,
    KVTransportOpt,
    ModelOpt,
    PresetOpt,
    ReasoningParserOpt,
    SetOpt,
    SpeculativeOpt,
    ToolCallParserOpt,
    resolve_flags,
)

app = typer.Typer(help="Serve or run a model.", no_args_is_help=True)

# (config field, flag, `serve` parameter): vLLM's serve flags with the same meaning, forwarded to --pd/--replicas
# workers as --set; then sage's own flags that name a config field
VLLM_STYLE_FLAGS = (
    ("model.served_name", "--served-model-name", "served_model_name"),
    ("model.max_model_len", "--max-model-len", "max_model_len"),
    ("model.dtype", "--dtype", "dtype"),
    ("kv_pool.memory_budget", "--kv-cache-memory-bytes", "kv_cache_memory_bytes"),
    ("kv_pool.memory_utilization", "--gpu-memory-utilization", "gpu_memory_utilization"),
    ("kv_pool.enable_prefix_caching", "--enable-prefix-caching", "enable_prefix_caching"),
    ("scheduler.max_num_seqs", "--max-num-seqs", "max_num_seqs"),
    ("scheduler.max_num_batched_tokens", "--max-num-batched-tokens", "max_num_batched_tokens"),
    ("scheduler.long_prefill_token_threshold", "--long-prefill-token-threshold", "long_prefill_token_threshold"),
    ("kv_pool.block_size", "--block-size", "block_size"),
    ("model.deterministic", "--deterministic", "deterministic"),
    ("model.tool_call_parser", "--tool-call-parser", "tool_call_parser"),
    ("model.reasoning_parser", "--reasoning-parser", "reasoning_parser"),
)
NAMED_FLAGS = (
    ("model.path", "--model", "model"), ("backend", "--backend", "backend"), ("host", "--host", "host"),
    ("port", "--port", "port"), ("api_key", "--api-key", "api_key"), ("role", "--role", "role"), ("pd", "--pd", "pd"),
    ("kv_pool.kv_dtype", "--kv-cache-dtype", "kv_cache_dtype"),
)


@app.command("serve")
def serve(
    model: ModelOpt = None,
    backend: BackendOpt = None,
    host: Annotated[Optional[str], typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (default 8000).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Require this bearer token.")] = None,
    preset: PresetOpt = None,
    config: ConfigFileOpt = None,
    kv_transport: KVTransportOpt = None,
    kv_tiers: KVTiersOpt = None,
    kv_cache_dtype: KVCacheDtypeOpt = None,
    set_: SetOpt = None,
    speculative_config: SpeculativeOpt = None,
    role: Annotated[Optional[str], typer.Option(
        "--role", help="prefill | decode | both (default): this instance's part in prefill/decode separation.")] = None,
    pd: Annotated[Optional[str], typer.Option(
        "--pd", help="Run xPyD here, e.g. 1P1D: x prefill and y decode workers behind one router URL.")] = None,
    replicas: Annotated[Optional[int], typer.Option(
        "--replicas", "--data-parallel-size", help="Run N whole-model replicas here, each on its own cores, behind "
        "one KV-aware router URL.")] = None,
    routing: Annotated[str, typer.Option(
        "--routing", help="Among the replicas of --replicas, or the prefill workers of --pd: kv (lowest estimated "
        "time to first token from their KV events), round-robin, random, least-load or session.")] = "kv",
    launcher: Annotated[str, typer.Option(
        "--launcher", help="With --pd or --replicas: local (processes of this command) or ray (Ray "
        "actors).")] = "local",
    ray_address: Annotated[Optional[str], typer.Option(
        "--ray-address", help="With --launcher ray: the Ray cluster to join (default: start a local one).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name", help="The model name clients send and /v1/models lists (model.served_name).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(
        "--max-model-len", help="Longest prompt + output in tokens (model.max_model_len; default: the "
        "model's own).")] = None,
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", help="Weight and compute dtype (model.dtype): auto, bfloat16, float16, float32.")] = None,
    kv_cache_memory_bytes: Annotated[Optional[str], typer.Option(
        "--kv-cache-memory-bytes", help="Bytes for the device KV cache, e.g. 4GiB or 4294967296 "
        "(kv_pool.memory_budget).")] = None,
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(
        "--gpu-memory-utilization", help="Share of free device memory (on CPU: of available memory) the KV "
        "cache takes when no byte budget is set (kv_pool.memory_utilization).")] = None,
    enable_prefix_caching: Annotated[Optional[bool], typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse the KV of cached prompt prefixes (kv_pool.enable_prefix_caching; default on).")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option(
        "--max-num-seqs", help="Most sequences in one step (scheduler.max_num_seqs).")] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(
        "--max-num-batched-tokens", help="Most tokens in one step (scheduler.max_num_batched_tokens).")] = None,
    long_prefill_token_threshold: Annotated[Optional[int], typer.Option(
        "--long-prefill-token-threshold", help="Most prompt tokens one request computes per step while others "
        "run or wait; 0: no cap (scheduler.long_prefill_token_threshold).")] = None,
    block_size: Annotated[Optional[int], typer.Option(
        "--block-size", help="Tokens per KV block (kv_pool.block_size).")] = None,
    deterministic: DeterministicOpt = None,
    tool_call_parser: ToolCallParserOpt = None,
    reasoning_parser: ReasoningParserOpt = None,
) -> None:
    """Start the OpenAI-compatible server (or, with --pd, a local prefill/decode deployment).

    The vLLM serve flags with the same meaning (--served-model-name, --max-model-len, --dtype,
    --kv-cache-memory-bytes, --gpu-memory-utilization, --enable-prefix-caching, --max-num-seqs,
    --max-num-batched-tokens, --long-prefill-token-threshold, --block-size, --tool-call-parser,
    --reasoning-parser) are accepted, so one command line or
    bench script drives both."""
    given = dict(locals())  # every flag by parameter name, as typed (None: not given)
    vllm_style = {field: (flag, given[name]) for field, flag, name in VLLM_STYLE_FLAGS}
    named = {**vllm_style, **{field: (flag, given[name]) for field, flag, name in NAMED_FLAGS}}
    _check_launch(pd, role, replicas, routing, launcher, ray_address)
    resolved = resolve_flags(preset, config, kv_transport, set_, named, kv_tiers, speculative_config)
    _check_pd_backend(resolved.config, launcher)
    if (resolved.config.pd is not None or replicas is not None) and resolved.config.role == "both":
        sets = [*(set_ or []), *([f"kv_pool.kv_dtype={kv_cache_dtype}"] if kv_cache_dtype else []),
                *(f"{field}={value}" for field, (_, value) in vllm_style.items() if value is not None)]
        args, secrets = _worker_args(resolved.config, model, preset, config, kv_transport, kv_tiers, sets,
                                     speculative_config)
        raise typer.Exit(_serve_deployment(resolved.config, args, secrets, replicas, routing, launcher, ray_address))
    _announce_startup(resolved)
    from sage_infer.server.launch import serve as run_server

    raise typer.Exit(run_server(resolved.config))


def _check_launch(pd: str | None, role: str | None, replicas: int | None, routing: str, launcher: str,
                  ray_address: str | None) -> None:
    """The flags that start a deployment (--pd, --replicas, --launcher, --ray-address) agree; UsageError if not."""
    from sage_infer.errors import UsageError

    if pd is not None and role is not None:
        raise UsageError("--pd starts its own prefill and decode workers: leave out --role")
    _check_replicas(replicas, routing, pd, role, launcher)
    if (launcher != "local" or ray_address is not None) and pd is None and replicas is None:
        raise UsageError("--launcher and --ray-address place the workers of --pd xPyD or --replicas N: give one")
    if launcher not in ("local", "ray"):
        raise UsageError(f"--launcher {launcher}: expected local or ray")


def _check_pd_backend(resolved, launcher: str) -> None:
    """A local P/D deployment runs the native or vllm backend, and vLLM workers on one host only."""
    from sage_infer.errors import ConfigError, UsageError

    if resolved.pd is not None and resolved.backend not in ("native", "vllm"):
        raise ConfigError(f"pd: a local prefill/decode deployment runs the native or vllm backend, not "
                          f"{resolved.backend}")
    if resolved.pd is not None and resolved.backend == "vllm" and launcher != "local":
        raise UsageError("--launcher ray: vLLM workers pull KV from 127.0.0.1 (one host); use --launcher local")


def _serve_deployment(resolved, args: list[str], secrets: dict[str, str], replicas: int | None, routing: str,
                      launcher: str, ray_address: str | None) -> int:
    """`--replicas N` (a fleet) or `--pd xPyD`, its workers started with `args` and `secrets`."""
    if replicas is not None:
        from sage_infer.router.replicas import serve_replicas

        return serve_replicas(replicas, args, resolved.host, resolved.port, secrets.get("SAGE_API_KEY"), routing,
                              resolved.tiers.disk_path, launcher, ray_address, secrets, resolved.model.path)
    return _serve_pd(resolved, args, secrets, launcher, ray_address, routing)


def _check_replicas(replicas: int | None, routing: str, pd: str | None, role: str | None, launcher: str) -> None:
    from sage_infer.errors import UsageError
    from sage_infer.router.replicas import check_routing

    if replicas is None:
        if routing != "kv" and pd is None:
            raise UsageError("--routing chooses among the replicas of --replicas N or the prefill workers of --pd "
                             "xPyD: give one")
        check_routing(routing)
        return
    check_routing(routing)
    if replicas < 1:
        raise UsageError(f"--replicas {replicas}: expected at least 1")
    if pd is not None:
        raise UsageError("--replicas with --pd: --pd xPyD already runs x prefill and y decode replicas behind one "
                         "router (--routing chooses among the prefill ones); leave out --replicas")
    if role is not None:
        raise UsageError("--replicas starts its own replicas: leave out --role")


def _worker_args(resolved, model, preset, config, kv_transport, kv_tiers, sets,
                 speculative_config=None) -> tuple[list[str], dict[str, str]]:
    """The flags every worker of `--pd` / `--replicas` gets (this command's model and config flags), and the secrets
    that reach them through the environment, not the process list: the API key and the transport's shared token (a
    fresh random one unless set)."""
    import os
    import secrets as pysecrets

    from sage_infer.config.overrides import without_secrets

    args: list[str] = []
    for flag, value in (("--model", model), ("--preset", preset), ("--config", config),
                        ("--backend", None if resolved.backend == "native" else resolved.backend),
                        ("--speculative-config", speculative_config)):
        if value is not None:
            args += [flag, str(value)]
    for flag, values in (("--kv-transport", without_secrets("--kv-transport", kv_transport)), ("--kv-tiers", kv_tiers),
                         ("--set", without_secrets("--set", sets))):
        for value in values or []:
            args += [flag, value]
    key = resolved.api_key.get_secret_value() if resolved.api_key else None
    token = resolved.kv_transport.auth_token
    # the channel between the workers always checks a shared token: the one set, else a fresh one for this run
    secrets = {"SAGE_API_KEY": key, "SAGE_KV_TRANSPORT__AUTH_TOKEN": token.get_secret_value() if token is not None
               else pysecrets.token_urlsafe(32)}
    secrets = {name: value for name, value in secrets.items() if value is not None}
    os.environ.update(secrets)  # inherited by local workers; Ray workers get them passed
    return args, secrets


def _serve_pd(resolved, args: list[str], secrets: dict[str, str], launcher="local", ray_address=None,
              routing: str = "kv") -> int:
    """`--pd xPyD`: the workers get `args`; the router takes this command's host, port, key and `router` section."""
    from sage_infer.router.launch import serve_pd

    transport = resolved.kv_transport
    group = transport.process_group if transport.backend == "torchdist" else None
    return serve_pd(resolved.pd, args, resolved.host, resolved.port, secrets.get("SAGE_API_KEY"),
                    resolved.tiers.disk_path, resolved.router, launcher, ray_address, group, secrets, routing,
                    resolved.model.path)


@app.command("router")
def router(
    prefill: Annotated[Optional[list[str]], typer.Option(
        "--prefill", help="A prefill worker's URL (repeat for several; none: decode workers compute prompts).")] = None,
    decode: Annotated[Optional[list[str]], typer.Option(
        "--decode", help="A decode worker's URL (repeat for several; at least one).")] = None,
    replica: Annotated[Optional[list[str]], typer.Option(
        "--replica", help="A whole-model replica's URL, a sage or vLLM server (repeat; instead of --prefill/"
        "--decode). A vLLM server publishing its KV events (--kv-events-config, publisher zmq): "
        "URL,events=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T], routed by its cached blocks.")] = None,
    routing: Annotated[str, typer.Option(
        "--routing", help="Among the --replica servers, or the --prefill workers: kv, round-robin, random, "
        "least-load or session.")] = "kv",
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", help="Require this bearer token from clients, send it to the workers (or SAGE_API_KEY).")] = None,
    tokenizer: Annotated[Optional[Path], typer.Option(
        "--tokenizer", help="With kv routing: the served model's directory; the router tokenizes text prompts "
        "itself to hash them (without it, it asks a worker for each prompt's hashes).")] = None,
) -> None:
    """One OpenAI endpoint in front of running servers: whole-model replicas (--replica, routed by their KV
    events), or prefill and decode workers: sage servers (--role prefill|decode) or vLLM servers with a P/D KV
    connector (SageKVConnector kv_producer / kv_consumer; docs/vllm_connector.md)."""
    import os

    from sage_infer.errors import UsageError
    from sage_infer.router.launch import serve_router
    from sage_infer.router.replicas import check_routing, probe_replicas, serve_fleet
    from sage_infer.router.vllm_events import parse_replica

    if replica and (prefill or decode):
        raise UsageError("--replica runs a fleet of whole-model replicas; --prefill/--decode a P/D deployment: "
                         "give one kind")
    if not decode and not replica:
        raise UsageError("--decode or --replica: give at least one worker URL")
    fleet = dict(parse_replica(value) for value in replica or [])
    for flag, urls in (("--prefill", prefill or []), ("--decode", decode or [])):
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise UsageError(f"{flag} {url}: expected an http(s) URL, e.g. http://127.0.0.1:8100")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: expected 0-65535")
    key = api_key or os.environ.get("SAGE_API_KEY") or None
    if tokenizer is not None:
        from sage_infer.models.loader import resolve_model_dir

        resolve_model_dir(tokenizer)  # a missing directory: one line, exit 2
    if replica:
        check_routing(routing)
        probe_replicas(list(fleet), key)
        vllm_events = {url: endpoints for url, endpoints in fleet.items() if endpoints is not None}
        raise typer.Exit(serve_fleet(list(fleet), host, port, key, routing, vllm_events=vllm_events,
                                     model_path=str(tokenizer) if tokenizer else None,
                                     local_tokenizer=tokenizer is not None))
    check_routing(routing)
    raise typer.Exit(serve_router(list(prefill or []), list(decode or []), host, port, key, routing=routing,
                                  model_path=str(tokenizer) if tokenizer else None,
                                  local_tokenizer=tokenizer is not None))


@app.command("generate")
def generate(
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="Prompt text (repeatable).")] = None,
    prompts_file: Annotated[
        Optional[Path], typer.Option("--prompts-file", help="One prompt per line, or JSONL with a prompt field.")
    ] = None,
    model: ModelOpt = None,
    backend: BackendOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.8,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = -1,
    seed: Annotated[Optional[int], typer.Option(help="Make sampling reproducible.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt as a user message (chat template).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON lines instead of text.")] = False,
    preset: PresetOpt = None,
    config: ConfigFileOpt = None,
    kv_transport: KVTransportOpt = None,
    kv_tiers: KVTiersOpt = None,
    kv_cache_dtype: KVCacheDtypeOpt = None,
    set_: SetOpt = None,
    speculative_config: SpeculativeOpt = None,
    deterministic: DeterministicOpt = None,
) -> None:
    """Generate text (the bundled demo model unless --model; the native engine unless --backend)."""
    from sage_infer.backends.offline import LLM
    from sage_infer.core.sampling_params import SamplingParams
    from sage_infer.errors import UsageError

    texts = list(prompt or []) + (_read_prompts(prompts_file) if prompts_file else [])
    if not texts:
        raise UsageError("sage llm generate: give --prompt TEXT or --prompts-file FILE")
    named = {"model.path": ("--model", model), "backend": ("--backend", backend),
             "kv_pool.kv_dtype": ("--kv-cache-dtype", kv_cache_dtype),
             "model.deterministic": ("--deterministic", deterministic)}
    resolved = resolve_flags(preset, config, kv_transport, set_, named, kv_tiers, speculative_config)
    _announce_startup(resolved)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except ValueError as err:
        raise UsageError(f"sage llm generate: {err}") from None
    llm = LLM(config=resolved.config)
    try:
        if chat:
            outputs = [llm.chat([{"role": "user", "content": t}], params)[0] for t in texts]
        else:
            outputs = llm.generate(texts, params, progress=len(texts) > 1 and not as_json and sys.stderr.isatty())
    finally:
        llm.close()
    for text, out in zip(texts, outputs):
        completion = out.outputs[0]
        if as_json:
            print(json.dumps({"prompt": text, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason, "error": out.error,
                              "ttft_s": out.metrics.ttft, "cached_tokens": out.metrics.num_cached_tokens}))
        elif out.error:
            print(f"error: {out.error}", file=sys.stderr)
        else:
            print(text + completion.text if not chat else completion.text)
            if len(texts) > 1:
                print("-" * 40)


def _announce_startup(resolved) -> None:
    """On stderr, once the engine starts building: one warning naming the inactive fields
    the user set, then one line per value `config.auto` decided, with its reason. Held
    back until then so a config or model error stays the one line it is."""
    from sage_infer.config.inactive import inactive_warning

    logger = logging.getLogger("sage_infer.auto")
    handler = next((h for h in logger.handlers if isinstance(h, _StartupLines)), None)
    if handler is None:  # one per process, however many commands run in it (tests)
        handler = _StartupLines()
        logger.addHandler(handler)
    handler.pending = inactive_warning(resolved.explicit_inactive_fields(), resolved.config)
    logger.setLevel(logging.INFO)


class _StartupLines(logging.Handler):
    """Writes ``sage: resolved <line>`` to the current sys.stderr (looked up per record, so
    a replaced stderr, as under pytest's capture, still gets them), after `pending`."""

    pending: str | None = None

    def emit(self, record) -> None:
        if self.pending:
            print(self.pending, file=sys.stderr)
            self.pending = None
        print(f"sage: resolved {record.getMessage()}", file=sys.stderr)


def _read_prompts(path: Path) -> list[str]:
    from sage_infer.errors import UsageError

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise UsageError(f"--prompts-file {path}: {err.strerror}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UsageError(f"{path}:{number}: expected a JSON object with a \"prompt\" field") from None
        else:
            prompts.append(line.replace("\\n", "\n"))
    return prompts


app.command("bench")(bench)  # defined in llm_bench.py; listed after serve and generate
