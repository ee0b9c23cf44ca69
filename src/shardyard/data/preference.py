"""Preference data (``data=preference``, for DPO): one pair per row, ``chosen`` and ``rejected`` after the same
prompt, rendered and labelled exactly as SFT does (``sft.encode``: the chat template, labels on the response's
assistant tokens only).

A record has ``prompt``, ``chosen`` and ``rejected``, each a string or a list of ``{"role", "content"}``
messages: a string prompt is the user's turn, a string chosen/rejected is the assistant's reply; a message-list
prompt is the conversation so far, and chosen/rejected lists hold the turn(s) that follow it. TRL's
conversational forms are read too: chosen/rejected lists that repeat the prompt's messages first (explicit
prompt), or no ``prompt`` at all and chosen/rejected carrying the whole conversations (implicit prompt: their
longest common leading messages). Only the response's assistant turns carry labels, never the prompt's.

Rows are ``[n, 2, seq_len]`` arrays (index 0 chosen, 1 rejected) in ``<split>.{input_ids,targets,position_ids}.npy``,
read by ``data.SFTRows``: each sequence right-padded (targets ``IGNORE``, positions restarting at 0 for the padding,
as ``sft.pack`` writes them). Without ``data.paths``: generated arithmetic pairs (``shardyard.data.synthetic``: chosen is
the right answer in the stated format, rejected a wrong one).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import numpy as np

from shardyard.data import synthetic
from shardyard.core.errors import UserError
from shardyard.data.sft import (IGNORE, ROLES, SUFFIXES, Drops, _json_type, encode, named_template, pack, template_for,
                           user_rows)

FIELDS = ("prompt", "chosen", "rejected")


def _messages(value, field: str, where: str, default_role: str) -> list[dict]:
    """A field as messages: a string is one ``default_role`` turn; a list is checked message by message."""
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else _json_type(value)
        raise UserError("data.paths", where, f"Its `{field}` is {what}, not a string or a list of messages.",
                        f"Give `{field}` as a string or a list of {{\"role\", \"content\"}} messages.")
    out = []
    for k, m in enumerate(value):
        if not (isinstance(m, dict) and "role" in m and "content" in m):
            raise UserError("data.paths", where, f"Its `{field}`'s element {k} is not a {{\"role\", \"content\"}} "
                            "message.", f"Fix `{field}`, or leave the record out.")
        if m["role"] not in ROLES:
            raise UserError("data.paths", where, f"Its `{field}`'s message {k} has the role {m['role']!r} (roles: "
                            f"{', '.join(ROLES)}).", "Rename the role, or leave the record out.")
        if not isinstance(m["content"], str):
            raise UserError("data.paths", where, f"Its `{field}`'s message {k} has {_json_type(m['content'])} as "
                            "content, not a string.", "Give every message's content as a string.")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def to_pair(record, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """``(prompt, chosen response, rejected response)`` messages of one record (module doc). A missing field, a
    wrong type or a response without an assistant turn exits 2 naming ``where`` (file:line)."""
    if not isinstance(record, dict):
        raise UserError("data.paths", where, f"The record is {_json_type(record)}, not a JSON object.",
                        "Fix or remove it: every record is an object with prompt, chosen and rejected.")
    missing = [f for f in FIELDS if f not in record or record[f] is None]
    implicit = missing == ["prompt"] and all(isinstance(record[f], list) for f in ("chosen", "rejected"))
    if missing and not implicit:
        raise UserError("data.paths", where, f"The record has no `{'`, `'.join(missing)}` (its keys: {sorted(record)}).",
                        "Give every record `prompt`, `chosen` and `rejected` (strings or message lists), or "
                        "conversational `chosen` and `rejected` lists that both start with the prompt's messages.")
    chosen = _messages(record["chosen"], "chosen", where, "assistant")
    rejected = _messages(record["rejected"], "rejected", where, "assistant")
    if implicit:  # TRL's implicit prompt: the messages both conversations start with
        k = 0
        while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
            k += 1
        while k > 0 and chosen[k - 1]["role"] == "assistant":
            k -= 1  # an identical assistant turn at the end of both belongs to the responses
        prompt = chosen[:k]
        if not prompt:
            raise UserError("data.paths", where, "The record has no `prompt`, and its `chosen` and `rejected` "
                            "conversations share no leading prompt message.", "Add a `prompt` field.")
    else:
        prompt = _messages(record["prompt"], "prompt", where, "user")
    for name, resp in (("chosen", chosen), ("rejected", rejected)):
        if len(resp) > len(prompt) and resp[:len(prompt)] == prompt:
            resp[:] = resp[len(prompt):]  # TRL's explicit-prompt conversational form repeats the prompt
        if not any(m["role"] == "assistant" for m in resp):
            raise UserError("data.paths", where, f"Its `{name}` has no assistant turn after the prompt: nothing to "
                            "prefer.", f"Give `{name}` as the assistant's reply (a string or assistant messages).")
    return prompt, chosen, rejected


def _blank(response: list[dict]) -> bool:
    """A response whose assistant turns say nothing (``""`` or blanks): no reply to prefer or reject."""
    return all(not m["content"].strip() for m in response if m["role"] == "assistant")


class PreferenceData:
    """``data=preference``: preference pairs from ``.jsonl``/``.json``/``.parquet``/``.arrow`` files or HF
    ``save_to_disk`` directories, or (no ``paths`` at all) generated arithmetic pairs."""

    kind = "preference"
    """The rows it gives (``objective=dpo`` trains on them; validation checks the pair)."""

    def __init__(self, paths: list[str], chat_template: str | None = None, truncation: str = "truncate",
                 max_examples: int = 2000, digits: int = 2, ops: str = "+-", seed: int = 0):
        if truncation not in ("truncate", "drop"):
            raise UserError("data.truncation", truncation, "Unknown truncation policy.",
                            "Use truncate (keep the first data.seq_len tokens) or drop (leave the pair out).")
        from shardyard.data.sources import input_files

        self.files: list[Path] = input_files(list(paths), SUFFIXES) if paths else []
        if not self.files:
            synthetic.check(digits, ops, max_examples)
        named_template(chat_template)
        self.chat_template, self.truncation, self.max_examples = chat_template, truncation, max_examples
        self.digits, self.ops, self.seed = digits, ops, seed

    def pairs(self) -> Iterator[tuple[str, list[dict], list[dict], list[dict]]]:
        """``(stable name, prompt, chosen, rejected)`` messages; the name decides the train/val split."""
        if not self.files:
            for name, p, wrong in synthetic.preference_pairs(self.max_examples, self.digits, self.ops, self.seed):
                prompt = [{"role": "user", "content": p.question()}]
                yield (name, prompt, [{"role": "assistant", "content": p.solution()}],
                       [{"role": "assistant", "content": p.solution(wrong)}])
            return
        for name, where, record in user_rows(self.files):
            yield (name, *to_pair(record, where))

    def documents(self) -> Iterator[tuple[str, str]]:
        """Plain text of every pair (for training a tokenizer when there is none)."""
        for name, prompt, chosen, rejected in self.pairs():
            yield name, "\n\n".join(m["content"] for m in prompt + chosen + rejected)

    def fingerprint(self) -> str:
        from shardyard.data.sources import _files_fingerprint

        settings = f"preference-v1|{self.chat_template}|{self.truncation}"
        if self.files:
            return _files_fingerprint(self.files, settings)
        generated = f"{settings}|{self.max_examples}|{self.digits}|{self.ops}|{self.seed}|{synthetic.HELD_OUT_PERCENT}"
        return hashlib.sha256(generated.encode()).hexdigest()[:16]

    def tokenize_rows(self, tok, seq_len: int, is_val) -> dict:
        """Every pair rendered, labelled and padded: ``{"train": arrays [n, 2, seq_len], "val": ..., "stats"}``."""
        template = template_for(tok, self.chat_template)
        seqs: dict[str, list[list[tuple[list[int], list[int]]]]] = {"train": [], "val": []}
        stats: dict = {"pairs": 0, "truncated": 0, "dropped": 0, "label_tokens": 0, "tokens": 0}
        drops = Drops()
        for name, prompt, chosen, rejected in self.pairs():
            split = "val" if is_val(name) else "train"
            stats["pairs"] += 1
            if _blank(chosen) or _blank(rejected) or chosen == rejected:
                stats["dropped"] += 1  # no preference to learn: DPO's loss is log 2 there, its gradient 0
                drops.drop(split, "tie" if chosen == rejected else "empty")
                continue
            both = [encode(tok, prompt + resp, template, first=len(prompt)) for resp in (chosen, rejected)]
            longest = max(len(ids) for ids, _ in both)
            if longest > seq_len:
                stats["truncated"] += 1
                if self.truncation == "drop":
                    stats["dropped"] += 1
                    drops.drop(split, "long", longest)
                    continue
            pair = []
            for ids, labels in both:
                ids, labels = ids[:seq_len], labels[:seq_len]
                pair.append((ids, labels[1:] + [IGNORE]))  # position t predicts token t+1
            if any(all(t == IGNORE for t in targets) for _, targets in pair):
                stats["dropped"] += 1  # truncation cut every response token of one side: no preference left
                drops.drop(split, "cut", longest)
                continue
            if pair[0] == pair[1]:
                stats["dropped"] += 1  # the sides differ only past data.seq_len: no preference left either
                drops.drop(split, "same", longest)
                continue
            stats["label_tokens"] += sum(t != IGNORE for _, targets in pair for t in targets)
            stats["tokens"] += sum(len(ids) for ids, _ in pair)
            seqs[split].append(pair)
            drops.keep(split)
        drops.check("preference pairs", seq_len, self.files)
        stats["no_preference"] = drops.count("tie") + drops.count("empty") + drops.count("same")
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out: dict = {}
        for split, pairs in seqs.items():
            sides = [pack([p[k] for p in pairs], seq_len, pad, packing=False) for k in (0, 1)]
            out[split] = {a: np.stack([sides[0][a], sides[1][a]], axis=1) for a in sides[0]}
        stats["summary"] = (f"{stats['pairs']:,} preference pairs, {stats['truncated']:,} with a side longer than "
                            f"data.seq_len={seq_len} ({stats['dropped']:,} dropped), {stats['label_tokens']:,} of "
                            f"{stats['tokens']:,} tokens carry a label (response tokens)"
                            + (f"; {stats['no_preference']:,} left out with no preference (chosen and rejected the "
                               "same, or one of them empty)" if stats["no_preference"] else ""))
        out["stats"] = stats
        return out
