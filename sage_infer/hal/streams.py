"""Side streams and events on an accelerator: work that runs beside the compute stream (KV loads layer by layer,
`sage_infer.kv_runtime.layer_loads`) and the waits that order it. CUDA only for now; the callers keep a CPU path of
their own."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of its own on `device`, for copies that overlap the compute stream's work."""
    if device.type != "cuda":
        raise ValueError(f"a copy stream needs a CUDA device, not {device}")
    return torch.cuda.Stream(device=device)


def on(stream: torch.cuda.Stream) -> AbstractContextManager:
    """Work queued inside goes to `stream`."""
    return torch.cuda.stream(stream)


def record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event that passes once everything queued on `stream` so far has run."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_for_current(stream: torch.cuda.Stream) -> None:
    """`stream`'s later work starts after what the current (compute) stream queued so far."""
    stream.wait_stream(torch.cuda.current_stream(stream.device))


def current_waits(event: torch.cuda.Event) -> None:
    """The current stream's later work starts after `event` (the host does not wait)."""
    torch.cuda.current_stream().wait_event(event)


def synchronize(event: torch.cuda.Event) -> None:
    """The host waits until the work before `event` has run."""
    event.synchronize()
