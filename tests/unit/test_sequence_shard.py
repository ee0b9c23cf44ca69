"""``sequence_parallel.shard``, the one function that cuts a micro-batch into a rank's share (issue 56 point 4), on
GRPO-shaped rows: left-padded prompts with an ``attention_mask`` and a length the split does not divide. No process
group is needed to cut (``Shards`` without a group)."""

import pytest
import torch

from shardyard.backends.sequence_parallel import ALL_GATHER, ULYSSES, Shards, shard
from shardyard.models.loss import SEQUENCE_SHARDS


@pytest.mark.parametrize("style,size", [(ULYSSES, 2), (ALL_GATHER, 2), (ULYSSES, 4)])
def test_padded_rows_are_cut_whole_and_masked_as_one_process_masks_them(style, size):
    """54 positions (a prompt of 48, left-padded by 5 and 9, and 6 completion tokens) are padded at the end to what
    the split divides: token 0, positions counting on, no target, masked off. Every rank's shares put together are
    the padded rows, and each rank's attention mask is the whole row's causal mask with the padding off (what
    transformers' SDPA mask of a padded batch is), restricted to the queries the rank computes."""
    length, pad = 54, [5, 9]
    ids = torch.randint(1, 100, (2, length))
    attn = torch.ones(2, length, dtype=torch.long)
    for row, n in enumerate(pad):
        attn[row, :n] = 0
    inputs = {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0)}
    targets = torch.full((2, length), -100)
    targets[:, 47:53] = ids[:, 48:54]
    parts = size if style == ULYSSES else 2 * size
    whole = -(-length // parts) * parts
    causal = torch.ones(whole, whole, dtype=torch.bool).tril()
    keys = torch.nn.functional.pad(attn, (0, whole - length)).bool()
    got = {k: torch.zeros(2, whole, dtype=torch.long) for k in ("input_ids", "position_ids", "targets")}
    for index in range(size):
        x, y = shard(inputs, targets, Shards(size, index, None, style))
        mine = Shards(size, index, None, style).positions(whole)
        for k, v in {**x, "targets": y}.items():
            if k in got:
                got[k][:, mine] = v
        queries = torch.arange(whole) if style == ULYSSES else mine
        want = (causal[queries][None] & keys[:, None, :])[:, None]
        assert torch.equal(x[SEQUENCE_SHARDS].mask(torch.device("cpu")), want), (style, index)
    more = whole - length
    assert torch.equal(got["input_ids"], torch.cat([ids, torch.zeros(2, more, dtype=torch.long)], 1))
    assert torch.equal(got["targets"], torch.cat([targets, torch.full((2, more), -100)], 1))
    last = inputs["position_ids"][:, -1:]
    assert torch.equal(got["position_ids"], torch.cat([inputs["position_ids"], last + torch.arange(1, more + 1)], 1))
