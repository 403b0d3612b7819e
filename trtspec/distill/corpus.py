"""A user's own conversations as distillation data (`trtspec distill --corpus FILE`).

Two formats, detected from the file:
  OpenAI messages   JSONL, one {"messages": [{"role": ..., "content": ...}, ...]} per line
  ShareGPT          JSON (a list) or JSONL of {"conversations": [{"from": ..., "value": ...}, ...]}

Each conversation is rendered with the target's chat template; the tokens of its assistant
turns are the response positions (the only ones trained on). Labels are the target's own
greedy tokens and top-k logits at those positions, captured by a teacher-forced forward
(data.capture_batch): one forward per conversation instead of one per generated token, and a
user's traffic is the distribution the head will draft on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trtspec.errors import SpecError
from trtspec.files import read_text_file

_ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}


@dataclass
class Conversation:
    tokens: list[int]
    response: torch.Tensor  # [T] bool: the assistant turns' tokens


def read_conversations(path: Path) -> list[list[dict]]:
    """Each conversation as [{"role", "content"}, ...]; SpecError names the line and the fix."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"--corpus: {path} does not exist; pass an OpenAI-messages JSONL or a ShareGPT JSON file")
    text = read_text_file(path, "--corpus")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"--corpus: {path}:{e.lineno}: not valid JSON ({e.msg}); fix the file") from e
        numbered = list(enumerate(rows, start=1))
        where = "item"
    else:
        numbered = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    numbered.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise SpecError(f"--corpus: {path}:{n}: not valid JSON ({e.msg}); one object per line") from e
        where = "line"
    out = []
    for n, row in numbered:
        messages = _messages(row)
        if messages is None:
            raise SpecError(
                f'--corpus: {path} {where} {n}: expected {{"messages": [{{"role": ..., "content": ...}}]}} '
                '(OpenAI) or {"conversations": [{"from": ..., "value": ...}]} (ShareGPT)'
            )
        if any(m["role"] == "assistant" for m in messages):
            out.append(messages)
    if not out:
        raise SpecError(f"--corpus: {path} holds no conversation with an assistant turn; nothing to train on")
    return out


def _messages(row) -> list[dict] | None:
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("messages"), list):
        turns = [(m.get("role"), m.get("content")) for m in row["messages"] if isinstance(m, dict)]
    elif isinstance(row.get("conversations"), list):
        turns = [(m.get("from"), m.get("value")) for m in row["conversations"] if isinstance(m, dict)]
    else:
        return None
    out = []
    for role, content in turns:
        role = _ROLES.get(str(role).lower())
        if role is None or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    return out or None


def tokenize_conversations(tok, conversations: list[list[dict]], max_len: int) -> tuple[list[Conversation], int]:
    """Chat-templated token ids with their assistant-turn mask, cut at ``max_len`` tokens; and
    how many conversations were skipped (no assistant token within max_len, or a template that
    does not render a conversation's prefix as a prefix of the whole)."""
    out, skipped = [], 0
    for messages in conversations:
        full = _ids(tok.apply_chat_template(messages, tokenize=True))
        mask = torch.zeros(len(full), dtype=torch.bool)
        sound = True
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            try:
                before = _ids(tok.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True))
                upto = _ids(tok.apply_chat_template(messages[: i + 1], tokenize=True))
            except Exception:  # noqa: BLE001 - a template that refuses a partial conversation (e.g. one starting with the assistant)
                sound = False
                break
            if full[: len(before)] != before or full[: len(upto)] != upto:
                sound = False
                break
            mask[len(before) : len(upto)] = True
        tokens, mask = full[:max_len], mask[:max_len]
        if not sound or not bool(mask[1:].any()):
            skipped += 1
            continue
        out.append(Conversation(tokens, mask))
    return out, skipped


def _ids(x) -> list[int]:
    """Token ids from apply_chat_template: a list, or a BatchEncoding (transformers 5)."""
    return list(x) if isinstance(x, list) else list(x["input_ids"])
