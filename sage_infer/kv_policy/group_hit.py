"""Prefix hits of a model with KV groups (sliding-window layers beside full-attention ones), over block names.

An engine with KV groups (`kv_runtime.kv_groups`) keeps a block table per group. Its KV events name a group's block by
the chained prefix hash of the block's tokens (the same hash in every group, as vLLM's events do) and the group:
`group_key` (group 0 by the bare hash, so a model without groups names blocks as before). A prefix hit needs every
block of the prefix in a full-attention group and only the last ``ceil((W - 1) / block_size)`` blocks before its end
in a sliding group of window ``W`` (`window_needs`); its length is the longest every group serves, asked again until
no group shortens it — the rule the engine's `GroupPrefix.match` follows, so a router predicts the hit the replica
will find (`longest_prefix`), each group's blocks taken from the device or a tier below it (`group_hit`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

GROUP_SEP = "@"
FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"  # vLLM's ``KVCacheSpecKind`` values


def group_key(name: str, group: int) -> str:
    """How the fleet index keys block `name` (a short chained hash) of KV group `group`."""
    return name if not group else f"{name}{GROUP_SEP}{group}"


def window_needs(kv_groups: Sequence[Mapping], block_size: int) -> tuple[int, ...]:
    """Per group (``{"kind", "sliding_window"}``, as a replica's recipe lists them), the blocks a prefix hit needs
    before its end: -1 every block (full attention), else ``ceil((W - 1) / block_size)``."""
    needs = []
    for group in kv_groups:
        window = group.get("sliding_window")
        needs.append(-1 if group.get("kind") != SLIDING_WINDOW or not window else -(-(int(window) - 1) // block_size))
    return tuple(needs)


def longest_prefix(present: Callable[[int, int], bool], length: int, needs: Sequence[int]) -> int:
    """The longest prefix, of at most `length` blocks, every group serves: `present(group, i)` says whether block
    ``i`` of ``group`` is held; `needs` as `window_needs` returns them."""
    while True:  # full groups serve any shorter prefix; a sliding group may not: ask again until all agree
        shortest = min((served_by(present, group, need, length) for group, need in enumerate(needs)), default=length)
        if shortest == length:
            return length
        length = shortest


def served_by(present: Callable[[int, int], bool], group: int, need: int, length: int) -> int:
    """The longest prefix of at most `length` blocks `group` serves when `present(group, i)` says whether its block
    `i` is there and a hit needs its last `need` blocks (every block from the start when `need` < 0): the engine's
    rule (`kv_runtime.group_prefix`) and the router's."""
    if need < 0:  # full: every block from the start
        return next((i for i in range(length) if not present(group, i)), length)
    if need == 0:
        return length
    run = 0
    for i in range(length - 1, -1, -1):  # from the right: the last `need` blocks before a prefix end
        if not present(group, i):
            run = 0
            continue
        run += 1
        if run == need:
            return i + need
    return run  # the window reaches the start: the `run` leading blocks are all it needs


def group_hit(where: Callable[[int, int], str | None], length: int, needs: Sequence[int],
              device: str) -> tuple[int, tuple[tuple[str, int], ...]]:
    """The longest prefix every group serves from `device` or a medium below it (`where(group, i)`: where block ``i``
    of ``group`` is, None: nowhere), and of its blocks those some group loads from below, by medium in prefix order
    (a block several groups load counts once, at the first group's medium)."""
    length = longest_prefix(lambda group, i: where(group, i) is not None, length, needs)
    lower: list[tuple[str, int]] = []
    for i in range(length):
        medium = next((m for group, need in enumerate(needs) if need < 0 or i >= length - need
                       if (m := where(group, i)) not in (device, None)), None)
        if medium is None:
            continue
        if lower and lower[-1][0] == medium:
            lower[-1] = (medium, lower[-1][1] + 1)
        else:
            lower.append((medium, 1))
    return length, tuple(lower)


def used_keys(names: Sequence[str], needs: Sequence[int]) -> tuple[str, ...]:
    """The keys of the blocks a request over a prompt of block `names` holds once its prompt is computed: every
    block of a full group, the window's last blocks of a sliding one."""
    keys = []
    for group, need in enumerate(needs):
        first = 0 if need < 0 else max(0, len(names) - need)
        keys += [group_key(name, group) for name in names[first:]]
    return tuple(keys)
