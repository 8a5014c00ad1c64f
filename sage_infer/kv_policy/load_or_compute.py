"""Load a prompt's blocks from a lower tier, or compute them again: decided per request from measured speeds.

A tier hit is worth having only when reading the blocks back is faster than the prefill it replaces; a slow tier
(a remote store over a busy link, a disk behind a queue) can cost more than recomputing, and then loading makes the
first token later, not sooner. `LoadOrCompute` keeps two measured rates, both moving averages of what this engine
actually did: the prefill rate and each tier's read rate (bytes per second of its reads; `kv_runtime.read_probe`
measures one read of each tier when the engine starts, before any request needs it).

The prefill rate is in FLOP/s of the model's prefill arithmetic (`ModelShape.prefill_flops`: the weights' 2 x params
per token plus attention over every earlier token), so a block deep in a long prompt, whose tokens attend to all
before them, is priced at what it costs there, not at an average token's cost; without a model shape it is plain
tokens per second. Steps that computed fewer than `MIN_PREFILL_TOKENS` prompt tokens are not counted.

A step's time is not proportional to its work: it has a fixed part (launching the layers' kernels, the step's host
work) that loading blocks does not save, since the loaded prompt still runs a step. On a GPU running eagerly the
fixed part dominates short steps (the H200 took ~14 ms for 16 tokens and ~16 for 256 of a 0.5B model). So besides
the average rate the steps are fitted with a line, ``seconds = fixed + work x per_work`` (`StepFit`, exponentially
weighted least squares); once the steps seen differ enough in size to tell, a block is priced at the marginal part
only, and the fixed part counts once per prefill step a load spares: a prompt computed in chunks of
`chunk_tokens` (the scheduler's step budget) needs fewer steps when its leading blocks are loaded. Each load also
costs engine time of its own (claiming the rows from the tiers, writing them into the pool), measured at admission
(`observe_load`) and fitted the same way: a fixed part per load and a part per block. The engine fits the step line
before its first request (`engine.prefill_probe` times steps of doubling size at start), and a step or load
`OUTLIER` times slower than predicted (a first use: a kernel compiled, a buffer page-locked) is left out. The line
prices blocks only as far into a prompt as the steps it was fitted on reached (`fitted_to`); past that, the average
rate does.

For a prompt whose next blocks sit below the device, it loads the leading run whose loading saves the most time
and computes the rest: block i saves ``its prefill work x marginal seconds per work - block bytes / its tier's read
rate - the load's cost per block``, a run also saves the fixed part of each step it spares, and a run is loaded
only when what it saves exceeds a load's fixed cost (a hit expected to lose less than `DECLINE_MIN_S` by loading is
loaded whole: the estimates cannot tell that apart). Until both rates are measured the blocks are loaded (what the
engine did before it knew better).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from sage_infer.kv_policy.cost_benefit import ModelShape

MIN_PREFILL_TOKENS = 256  # a step that computed fewer prompt tokens says more about its overheads than the rate
MIN_READ_BYTES = 1 << 16  # likewise for a tier read
WEIGHT = 0.2  # of the newest observation in a rate's moving average
FIT_WEIGHT = 0.05  # of the newest step in the step-cost line (it needs steps of several sizes in its memory)
FIT_MIN_STEPS = 4  # steps before the line is used
FIT_MIN_SPREAD = 0.25  # the steps' work must spread at least this (std / mean) for a slope to mean anything
# a step slower than this many times the line's prediction is left out of it (a kernel compiled for a new shape, a
# buffer page-locked on first use: one such step bent a GPU's line tenfold), unless `MAX_OUTLIERS` came just before
# it: then the machine changed (another load on it) and the line follows
OUTLIER = 3.0
MAX_OUTLIERS = 3
# a hit is declined (computed instead) only where loading it is expected to cost at least this much more: below it
# the estimates are noise (a small model's steps and reads of well under a millisecond), and the hit is kept
DECLINE_MIN_S = 0.001


@dataclass(slots=True)
class Rate:
    """A moving average of units per second; None until observed."""

    per_s: float | None = None
    observations: int = 0

    def observe(self, units: float, seconds: float) -> None:
        rate = units / seconds
        self.per_s = rate if self.per_s is None else self.per_s + WEIGHT * (rate - self.per_s)
        self.observations += 1


@dataclass(slots=True)
class StepFit:
    """Prefill steps' seconds as ``fixed + work x per_work``: an exponentially weighted least-squares line through
    (work, seconds) of the steps seen."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    observations: int = 0
    outliers: int = 0  # left out in all
    _in_a_row: int = 0
    _line: tuple[float, float] | None = None  # `line`, solved once per observation (a decision prices every block)
    _stale: bool = True

    def observe(self, work: float, seconds: float, expected: float | None = None, screen: bool = True) -> bool:
        """Fit one step; False where it was left out as an outlier (`OUTLIER` times the line's prediction, or
        `expected` until there is a line; `screen=False`: never, a step timed on purpose)."""
        line = self.line() if screen else None
        if line is not None:
            expected = line[0] + work * line[1]
        if screen and expected is not None and seconds > OUTLIER * expected and self._in_a_row < MAX_OUTLIERS:
            self._in_a_row += 1
            self.outliers += 1
            return False
        self._in_a_row = 0
        keep = 1.0 - FIT_WEIGHT
        self.n = self.n * keep + 1.0
        self.sx = self.sx * keep + work
        self.sy = self.sy * keep + seconds
        self.sxx = self.sxx * keep + work * work
        self.sxy = self.sxy * keep + work * seconds
        self.observations += 1
        self._stale = True
        return True

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per unit of work); None until `FIT_MIN_STEPS` steps whose work spreads enough
        to tell a slope (steps all of one size say nothing about it). Points on no rising line are flat: their
        mean, and no cost per unit of work."""
        if self._stale:
            self._line, self._stale = self._solve(), False
        return self._line

    def _solve(self) -> tuple[float, float] | None:
        if self.observations < FIT_MIN_STEPS:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mean_x * mean_x
        if var <= (FIT_MIN_SPREAD * mean_x) ** 2:
            return None
        slope = (self.sxy / self.n - mean_x * mean_y) / var
        if slope <= 0:  # steps of different sizes cost the same: their work adds nothing a load could save
            return mean_y, 0.0
        return max(0.0, mean_y - slope * mean_x), slope


@dataclass
class LoadOrCompute:
    """The measured prefill and tier read rates of one engine, and the decision they make (`blocks_to_load`).
    Observed on the engine thread (prefill, reads at admission) and a loader thread (prefetch reads).

    `shape`: prices prefill work in FLOPs by position (None: every token costs the same). `chunk_tokens`: the most
    prompt tokens a step computes (chunked prefill's budget; None: a prompt is one step, loads spare no step)."""

    block_tokens: int
    block_nbytes: int
    shape: ModelShape | None = None
    chunk_tokens: int | None = None
    prefill: Rate = field(default_factory=Rate)  # FLOP/s with a shape, tokens/s without
    steps: StepFit = field(default_factory=StepFit)  # step seconds as fixed + marginal work
    reads: dict[int, Rate] = field(default_factory=dict)  # tier level (1 = fastest lower tier) -> bytes per second
    loads: StepFit = field(default_factory=StepFit)  # a load's own engine time as fixed + per block
    load_s: float | None = None  # that time's moving average, a load's fixed cost until the line is known
    fitted_to: int = 0  # the furthest prompt position a fitted step computed (the line says nothing past it)
    probed: tuple[tuple[int, float], ...] = ()  # (tokens, seconds) of the steps timed at start (`engine.prefill_probe`)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def work(self, tokens: int, context: int) -> float:
        """Prefill work of `tokens` prompt tokens after `context` earlier ones: FLOPs with a shape, else tokens."""
        return float(tokens) if self.shape is None else self.shape.prefill_flops(tokens, context)

    def observe_prefill(self, spans: Sequence[tuple[int, int]], seconds: float, only_prefill: bool = True,
                        screen: bool = True) -> None:
        """One step that computed prompt tokens: `spans` = (tokens, context before them) per sequence, `seconds`
        until its tokens were on the host (on a GPU the forward runs after its launch returns). `only_prefill`: the
        step had no other rows (decode rows' time would read as the line's fixed part). `screen=False`: a step timed
        on purpose (the start-up probe's), never left out as an outlier."""
        if not spans or seconds <= 0:
            return
        work = sum(self.work(tokens, context) for tokens, context in spans)
        with self._lock:
            # every size: the short steps are what shows the fixed part; an outlier moves neither the line nor the rate
            if only_prefill:
                if not self.steps.observe(work, seconds, screen=screen):
                    return
                self.fitted_to = max(self.fitted_to, max(tokens + context for tokens, context in spans))
            if sum(tokens for tokens, _ in spans) >= MIN_PREFILL_TOKENS:
                self.prefill.observe(work, seconds)

    def observe_load(self, seconds: float, blocks: int) -> None:
        """One load of `blocks` blocks took `seconds` of the engine's time at admission (taking its rows from the
        tiers, writing them into the pool)."""
        if blocks > 0 and seconds > 0:
            with self._lock:
                if self.loads.observe(blocks, seconds, self.load_s):  # (an outlier moves neither)
                    self.load_s = seconds if self.load_s is None else self.load_s + WEIGHT * (seconds - self.load_s)

    def load_cost(self) -> tuple[float, float]:
        """(fixed seconds of a load, seconds per block loaded) of the engine's time: the fitted line once the loads
        seen differ enough in size, before that their average as a fixed cost; (0, 0) until one was seen."""
        line = self.loads.line()
        if line is not None:
            return line
        return (self.load_s or 0.0, 0.0)

    def measured(self) -> tuple[dict[int, float], tuple[float, float] | None, tuple[float, float] | None]:
        """What it measured, read together (a scrape may run beside the engine thread): each tier level's read
        rate in bytes per second, the fitted step line and the load cost (None where not measured yet)."""
        with self._lock:
            reads = {level: rate.per_s for level, rate in self.reads.items() if rate.per_s}
            return reads, self.steps.line(), self.load_cost() if self.load_s is not None else None

    def step_fixed_s(self) -> float:
        """The fixed part of a prefill step (0 until the fitted line is known)."""
        line = self.steps.line()
        return line[0] if line is not None else 0.0

    def steps_spared(self, compute_tokens: int | None, loaded_tokens: int) -> int:
        """Prefill steps a prompt that would compute `compute_tokens` needs fewer with `loaded_tokens` of them loaded
        (its last token is computed either way)."""
        if compute_tokens is None or not self.chunk_tokens:
            return 0
        left = max(1, compute_tokens - loaded_tokens)
        return -(-compute_tokens // self.chunk_tokens) - -(-left // self.chunk_tokens)

    def observe_read(self, level: int, nbytes: int, seconds: float) -> None:
        if nbytes >= MIN_READ_BYTES and seconds > 0:
            with self._lock:
                self.reads.setdefault(level, Rate()).observe(nbytes, seconds)

    def prefill_s(self, tokens: int, context: int) -> float | None:
        """Expected seconds that computing `tokens` prompt tokens after `context` adds to a step (None: not measured
        yet): the fitted line's marginal part once it is known and the steps it was fitted on reached that far into a
        prompt, else at the average rate (a line fitted on short steps, flat where launches dominate, would price the
        attention over a long context at nothing)."""
        rate = self.prefill.per_s
        if rate is None:
            return None
        line = self.steps.line()
        per_work = line[1] if line is not None and context + tokens <= self.fitted_to else 1.0 / rate
        return self.work(tokens, context) * per_work

    def saving_s(self, level: int, block: int = 0) -> float | None:
        """Seconds loading block number `block` of a prompt from tier `level` saves against computing it
        (None: not measured yet)."""
        read = self.reads.get(level)
        compute = self.prefill_s(self.block_tokens, block * self.block_tokens)
        if compute is None or read is None or read.per_s is None:
            return None
        return compute - self.block_nbytes / read.per_s

    def worth_reading(self, levels: Sequence[int], tokens: int, context: int) -> bool:
        """Whether reading blocks from tiers `levels` (one entry per block) is faster than computing the `tokens`
        prompt tokens after `context` they stand for, all or none (a hybrid hit: its blocks cover more tokens than
        they number); True while a rate is unmeasured."""
        compute = self.prefill_s(tokens, context)
        if compute is None:
            return True
        fixed, per_block = self.load_cost()
        seconds = fixed + per_block * len(levels)
        for level in levels:
            read = self.reads.get(level)
            if read is None or read.per_s is None:
                return True
            seconds += self.block_nbytes / read.per_s
        return seconds < compute + DECLINE_MIN_S

    def blocks_to_load(self, levels: Sequence[int], first_block: int = 0, compute_tokens: int | None = None) -> int:
        """Of a prompt's next blocks below the device (`levels[i]`: the tier holding block ``first_block + i``), how
        many leading ones to load: the run whose loading saves the most time in all (every one while a rate is
        unmeasured). `compute_tokens`: the prompt tokens it computes if nothing is loaded (for the steps a load
        spares; None: none counted)."""
        fixed_load, per_block = self.load_cost()
        fixed_step = self.step_fixed_s()
        best = best_at = total = spared = 0.0
        for i, level in enumerate(levels):
            saving = self.saving_s(level, first_block + i)
            total += saving - per_block if saving is not None else float("inf")
            spared = fixed_step * self.steps_spared(compute_tokens, (i + 1) * self.block_tokens)
            if total + spared >= best:
                best, best_at = total + spared, i + 1
        if best > fixed_load:
            return int(best_at)
        # no run pays for the load itself: the hit is declined where loading it all is expected to lose more than
        # the estimates can tell apart, else kept
        return len(levels) if total + spared - fixed_load > -DECLINE_MIN_S else 0
