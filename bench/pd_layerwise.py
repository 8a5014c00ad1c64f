"""Does sending KV layer by layer while prefill computes later layers pay, on this machine?

    PYTHONPATH=$PWD .venv/bin/python bench/pd_layerwise.py --json out/pd_layerwise.json

One prompt is prefilled by the native engine's model runner into its paged pool, and its KV goes
to a receiving `KVPipe` (a real shm or tcp channel; the receiver runs its own loop thread in
this process, as a decode worker's would in its own) in one of two ways:

- **after**: prefill all layers, then `read_blocks` the prompt's blocks and send them as one
  transfer (what `--role prefill` does today);
- **layerwise**: a forward hook on each decoder layer sends that layer's K/V of the prompt's
  blocks as its own transfer as soon as the layer has stored it, while the next layers compute.

Reported per prompt length: prefill alone, transfer alone, the two end-to-end times (prefill start
to the last byte verified at the receiver), and layerwise ÷ after (< 1: it pays). Both move the same
bytes; medians of `--repeats`. Models: random Llamas from tests/tiny_models.py, sized by flags.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_infer import LLM  # noqa: E402
from sage_infer.config.transport import KVTransportConfig  # noqa: E402
from sage_infer.core.sampling_params import SamplingParams  # noqa: E402
from sage_infer.core.sequence import Sequence  # noqa: E402
from sage_infer.kv_runtime.kv_pipe import KVPipe  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

WAIT_S = 60.0


def wait_received(receiver: KVPipe, ids: set[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    pending = set(ids)
    while pending:
        for result in receiver.poll_received():
            if not result.ok:
                raise RuntimeError(f"transfer {result.transfer_id} failed: {result.error}")
            pending.discard(result.transfer_id)
        if time.monotonic() > deadline:
            raise RuntimeError(f"transfers {sorted(pending)} did not arrive")
        time.sleep(0.0002)


class Layerwise:
    """Forward hooks that send each layer's K/V of the current prompt's blocks once the layer ran."""

    def __init__(self, llm: LLM, sender: KVPipe, address: str) -> None:
        self.pool = llm.engine.runner.pool
        self.sender, self.address = sender, address
        self.block_ids: torch.Tensor | None = None
        self.tag = ""
        self.hooks = [layer.register_forward_hook(self._hook(i))
                      for i, layer in enumerate(llm.engine.runner.model.model.layers)]

    def _hook(self, index: int):
        def after_layer(_module, _inputs, _output) -> None:
            if self.block_ids is None:
                return
            k, v = self.pool._blocks[index]
            rows = torch.stack([k.index_select(0, self.block_ids), v.index_select(0, self.block_ids)], 1)
            rows = rows.view(torch.uint8).reshape(-1, self.pool.schema.bytes_per_block)
            self.sender.start_send(f"{self.tag}-L{index}", self.address, rows, [bytes(32)] * rows.shape[0])
        return after_layer

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def prefill_once(llm: LLM, tokens: list[int], blocks: list[int]) -> None:
    seq = Sequence(0, "bench", 0, list(tokens), len(tokens), SamplingParams(max_tokens=1), b"")
    seq.block_table = blocks
    llm.engine.runner.run([seq], [len(tokens)])


def measure(llm: LLM, backend: str, prompt_len: int, repeats: int) -> dict:
    pool = llm.engine.runner.pool
    bs = pool.block_size
    layers = pool.num_layers
    n = prompt_len // bs // layers * layers  # a layer's rows make whole blocks on the connector's wire
    blocks = list(range(1, n + 1))
    ids = torch.tensor(blocks)
    tokens = [5 + (7 * i) % 400 for i in range(n * bs)]
    hashes = [bytes(32)] * n  # the receiver here registers nothing, so it checks no hashes
    config = KVTransportConfig(timeout_s=WAIT_S)
    receiver = KVPipe(pool.schema, config, backend=backend, listen=True)
    sender = KVPipe(pool.schema, config, backend=backend)
    hooks = Layerwise(llm, sender, receiver.address)
    times: dict[str, list[float]] = {"prefill": [], "transfer": [], "after": [], "layerwise": []}
    try:
        for r in range(repeats + 1):  # the first round warms up (connections, allocations)
            t0 = time.perf_counter()
            prefill_once(llm, tokens, blocks)
            prefill_s = time.perf_counter() - t0

            receiver.expect(f"t{r}", n)
            t0 = time.perf_counter()
            sender.start_send(f"t{r}", receiver.address, pool.read_blocks(ids).view(torch.uint8).reshape(n, -1), hashes)
            wait_received(receiver, {f"t{r}"})
            transfer_s = time.perf_counter() - t0

            receiver.expect(f"a{r}", n)
            t0 = time.perf_counter()
            prefill_once(llm, tokens, blocks)
            sender.start_send(f"a{r}", receiver.address, pool.read_blocks(ids).view(torch.uint8).reshape(n, -1), hashes)
            wait_received(receiver, {f"a{r}"})
            after_s = time.perf_counter() - t0

            names = {f"l{r}-L{i}" for i in range(layers)}  # a layer of n blocks is n / layers connector rows
            for name in names:
                receiver.expect(name, n // layers)
            hooks.block_ids, hooks.tag = ids, f"l{r}"
            t0 = time.perf_counter()
            prefill_once(llm, tokens, blocks)
            wait_received(receiver, names)
            layerwise_s = time.perf_counter() - t0
            hooks.block_ids = None
            if r:
                for key, value in zip(times, (prefill_s, transfer_s, after_s, layerwise_s)):
                    times[key].append(value * 1e3)
    finally:
        hooks.remove()
        sender.close()
        receiver.close()
    med = {f"{k}_ms": statistics.median(v) for k, v in times.items()}
    med.update(prompt_tokens=n * bs, kv_bytes=n * pool.schema.bytes_per_block, layers=layers,
               layerwise_over_after=med["layerwise_ms"] / med["after_ms"])
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-lens", default="512,2048")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--backend", default="shm", choices=("shm", "tcp"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "m", "llama", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=args.kv_heads,
                               num_key_value_heads=args.kv_heads, max_position_embeddings=8192)
        llm = LLM(str(path), dtype="fp32", num_blocks=600, max_model_len=8192)
        results = [measure(llm, args.backend, int(p), args.repeats) for p in args.prompt_lens.split(",")]
    print(f"{'prompt':>7} {'KV MiB':>7} {'prefill':>9} {'transfer':>9} {'after':>9} {'layerwise':>10} {'ratio':>6}")
    for row in results:
        print(f"{row['prompt_tokens']:>7} {row['kv_bytes'] / 2**20:>7.1f} {row['prefill_ms']:>8.1f}ms "
              f"{row['transfer_ms']:>8.1f}ms {row['after_ms']:>8.1f}ms {row['layerwise_ms']:>9.1f}ms "
              f"{row['layerwise_over_after']:>6.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "args": vars(args)
                                         | {"json": str(args.json)}, "threads": args.threads, "results": results},
                                        indent=2))


if __name__ == "__main__":
    main()
