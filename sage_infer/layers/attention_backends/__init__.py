"""Attention backends: the ways a step's attention runs over the paged KV pool, as objects chosen once at build.

An `AttentionBackend` (`base.py`) is a decode part and a prefill part, each one file here, registered below by the
name the config gives it and imported only when asked for (a part that needs Triton or an accelerator's library
never breaks `import sage_infer`):

| part | config | file | what runs |
|---|---|---|---|
| decode `torch` | `attention: torch` | `gathered_decode.py` | rows over gathered copies, PyTorch (the oracle) |
| decode `paged` | `attention: paged` | `paged_decode.py` | rows read blocks in place: C++ (CPU), Triton (GPU) |
| prefill `torch` | `prefill_attention: torch` | `torch_prefill.py` | spans one by one, PyTorch SDPA (the oracle) |
| prefill `flash` | `prefill_attention: sage`, CPU | `flash_prefill.py` | spans and shared prefixes, sage flash kernel |
| prefill `flash_amx` | `sage`, bf16, CPU with AMX | `flash_prefill.py` | the same through PyTorch's (AMX) |
| prefill `triton` | `prefill_attention: sage`, GPU | `triton_prefill.py` | every span in one launch, in place |

(`attention` and `prefill_attention` are fields of the config's `model` section.)

Each backend derives its own metadata from the step's neutral batch (`AttentionBackend.prepare`, the parts'
`groups` and `prepare`); every layer calls `paged_attention`, which is the backend's `forward`.
`sage_infer.engine.build` decides which parts run here (each fast part only where it can, with a start-up line
saying why). A new device path (an Ascend or MLU kernel, a GPU flash kernel) is a new file here and one line below.
"""

from __future__ import annotations

import importlib

from sage_infer.layers.attention_backends.base import AttentionBackend, DecodePart, PrefillPart

DECODE_PARTS: dict[str, str] = {  # name -> module:class, imported when chosen
    "torch": "gathered_decode:GatheredDecode",
    "paged": "paged_decode:PagedDecode",
}
PREFILL_PARTS: dict[str, str] = {
    "torch": "torch_prefill:TorchPrefill",
    "flash": "flash_prefill:FlashPrefill",
    "flash_amx": "flash_prefill:AmxFlashPrefill",
    "triton": "triton_prefill:TritonPrefill",
}


def _part(table: dict[str, str], kind: str, name: str) -> object:
    if name not in table:
        raise ValueError(f"unknown {kind} attention part {name!r} (known: {', '.join(table)})")
    module, cls = table[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()


def attention_backend(decode: str = "torch", prefill: str = "torch", row_invariant: bool = False) -> AttentionBackend:
    """The backend of the registered decode part `decode` and prefill part `prefill`."""
    return AttentionBackend(decode=_part(DECODE_PARTS, "decode", decode),
                            prefill=_part(PREFILL_PARTS, "prefill", prefill), row_invariant=row_invariant)


REFERENCE = attention_backend()  # PyTorch ops only: what every faster part is tested against
PAGED_DECODE = attention_backend(decode="paged")  # the decode kernel in place, the reference prefill

__all__ = ["DECODE_PARTS", "PAGED_DECODE", "PREFILL_PARTS", "REFERENCE", "AttentionBackend", "DecodePart",
           "PrefillPart", "attention_backend"]
