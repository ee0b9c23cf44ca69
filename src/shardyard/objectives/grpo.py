"""``objective=grpo``: group-relative policy optimisation with verifiable rewards (DeepSeekMath, Shao et al.
2024; DeepSeek-R1), on ``data=prompts``, with DAPO's asymmetric clip (Yu et al. 2025) as an option.

    python train.py objective=grpo data=prompts model.weights=outputs/.../hf
    python train.py recipe=r1_zero_tiny_grpo

A round: each prompt of the step's batch is completed ``num_generations`` (G) times by the policy itself, sampled
with a KV cache (``shardyard.models.generation``) on the engine's own sharded module; the rewards (``objective.rewards``,
each a callable chosen by ``_target_``, never executing what the model wrote) are summed with their weights and
turned into advantages within each group of G (``scale_rewards``). The round's rollouts are then trained on for
``num_iterations`` optimizer steps, ``train.grad_accum_steps`` micro-batches of prompts x G completions each: the
clipped surrogate ``min(ratio x A, clip(ratio, 1 - epsilon, 1 + epsilon_high) x A)`` per completion token, ratio
to the policy that sampled them (its log-probs are those of the round's first step, taken in that step's own
forward), minus ``beta`` x the k3 estimate of KL to the reference (the starting policy, frozen: LoRA disables the
adapters, else ``Backend.reference_model``; times the ratio with ``use_bias_correction_kl``, TRL's default),
aggregated per token (``loss_aggregation=token``: every completion token of the step counts once, DAPO) or per
completion (``sequence``: each completion's token mean counts once, the GRPO paper). Either is a sum over units divided by their number, which the loop's token weighting makes exact
over micro-batches and ranks. Every log-probability of a rollout (the sampling policy's, the policy's, the
reference's) is of ``logits / temperature``, the distribution the rollouts were drawn from, as TRL computes them.

Every rank samples its own prompts (its data-parallel share, seeded by seed, round, data-parallel rank and
micro-batch: tensor-parallel peers draw the same tokens); on a sharded engine every rank runs exactly
``max_new_tokens`` forwards (``lockstep``), so the engine's collectives inside them line up. The round's rollouts
are part of a checkpoint taken inside it, so a resume in the middle of a round trains on the same completions.

``backend.sp`` / ``backend.cp``: the ranks of a sequence group read the same prompts and sample with the same seed
(their data-parallel rank is the group's), generate whole sequences in lockstep, and keep the group's first rank's
completions (``sequence_parallel.from_first``); the training forward of the policy and the reference runs on the
rank's share of each prompt + completion row (``sequence_parallel.shard``, the row padded to the split when it does
not divide, left padding masked as one process masks it). Every term of the loss is per token, so each rank sums
its share: ``counts`` are its share's completion tokens (``token``), or, per completion (``sequence``), each row's
token mean taken with the whole row's length and the rows counted on the group's first rank.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional

import torch

from shardyard.models import moe
from shardyard.models.adapters import is_peft
from shardyard.backends import Backend, sequence_parallel
from shardyard.config.schema import GRPOObjectiveConfig
from shardyard.core.errors import UserError
from shardyard.objectives import Setup, install
from shardyard.objectives.losses import aggregate, group_advantages, grpo_per_token, token_logps
from shardyard.objectives.rewards import build_rewards

AGGREGATIONS = ("token", "sequence")
SCALES = ("group", "batch", "none")
STATE_DIR = "rollouts"
"""Inside a checkpoint: ``rollouts/rank<r>/`` holds rank r's batch of rollouts in use (``save``)."""


class GRPO:
    data_kind = "prompts"
    """The rows it trains on (a data option's ``kind``), checked at validation."""
    loss_falls = False
    """The loop's warnings on a flat or oscillating train loss do not apply: the surrogate's value is no measure of
    progress (the reward is)."""
    splits_sequences = True
    """Under ``backend.sp`` / ``backend.cp`` it samples whole rollouts and trains on the rank's share of their
    positions (``_split``)."""

    def __init__(self, name: str = "grpo", num_generations: int = 8, max_new_tokens: int = 64,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, epsilon: float = 0.2,
                 epsilon_high: Optional[float] = None, beta: float = 0.0, loss_aggregation: str = "token",
                 num_iterations: int = 1, scale_rewards: str = "group", rewards: Any = (),
                 eval_max_new_tokens: Optional[int] = None, reference_weights: Optional[str] = None,
                 use_bias_correction_kl: bool = GRPOObjectiveConfig.use_bias_correction_kl):
        def refuse(key: str, value: Any, problem: str, fix: str) -> None:
            raise UserError(f"objective.{key}", value, problem, fix)

        if num_generations < 2:
            refuse("num_generations", num_generations, "GRPO's advantages compare the completions of one prompt "
                   "with each other: a group of fewer than 2 has nothing to compare.", "Use e.g. 8.")
        if not epsilon > 0:
            refuse("epsilon", epsilon, "The clip range of the policy ratio must be above 0.", "Use e.g. 0.2.")
        if epsilon_high is not None and not epsilon_high > 0:
            refuse("epsilon_high", epsilon_high, "DAPO's upper clip range must be above 0.",
                   "Use e.g. 0.28, or null for epsilon.")
        if not beta >= 0:
            refuse("beta", beta, "The KL penalty's weight cannot be negative.", "Use 0 (no reference model) or e.g. 0.04.")
        if loss_aggregation not in AGGREGATIONS:
            refuse("loss_aggregation", loss_aggregation, "Unknown aggregation.", f"Use one of {list(AGGREGATIONS)}.")
        if scale_rewards not in SCALES:
            refuse("scale_rewards", scale_rewards, "Unknown advantage scaling.", f"Use one of {list(SCALES)}.")
        if num_iterations < 1:
            refuse("num_iterations", num_iterations, "Each batch of rollouts is trained on at least once.", "Use 1 or more.")
        if not temperature > 0:
            refuse("temperature", temperature, "Greedy rollouts make the G completions of a prompt identical: every "
                   "advantage is 0 and nothing is learned.", "Use a temperature above 0, e.g. 1.0.")
        if not 0 < top_p <= 1 or top_k < 0:
            refuse("top_p" if not 0 < top_p <= 1 else "top_k", top_p if not 0 < top_p <= 1 else top_k,
                   "top_p is in (0, 1] and top_k at least 0 (0: no top-k filter).", "Use top_p=1.0 and top_k=0.")
        if max_new_tokens < 1:
            refuse("max_new_tokens", max_new_tokens, "A completion has at least one token.", "Use e.g. 64.")
        if eval_max_new_tokens is not None and eval_max_new_tokens < 1:
            refuse("eval_max_new_tokens", eval_max_new_tokens, "A completion has at least one token.",
                   "Use null (max_new_tokens) or e.g. 64.")
        self.name, self.G, self.max_new_tokens = name, num_generations, max_new_tokens
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.epsilon, self.epsilon_high, self.beta = epsilon, epsilon_high if epsilon_high is not None else epsilon, beta
        self.bias_correction_kl = bool(use_bias_correction_kl)
        self.aggregation, self.num_iterations, self.scale = loss_aggregation, num_iterations, scale_rewards
        self.eval_max_new_tokens = eval_max_new_tokens or max_new_tokens
        self.rewards = build_rewards(rewards)  # exit 2 naming objective.rewards[i] (none, a bad _target_, ...)
        self.buffer: Optional[list] = None
        self.failed: Optional[UserError] = None
        """A reward's error on this rank in the round being sampled (``_agree``)."""
        self.round = -1
        self.shards: Optional[sequence_parallel.Shards] = None

    @staticmethod
    def sequences(o: Any, seq_len: int) -> tuple[int, int]:
        """Per prompt: G rows of the prompt (``seq_len``, left-padded) and its completion (``objectives.sequences``)."""
        return int(o.num_generations), seq_len + max(int(o.max_new_tokens), int(o.get("eval_max_new_tokens") or 0))

    @staticmethod
    def held(o: Any) -> tuple[bool, float]:
        """A reference model when ``beta`` > 0; the round's rollouts: four int64 rows (ids, mask, positions,
        targets) and the fp32 log-probs of the sampling policy and the reference (``objectives.held``)."""
        beta = float(o.beta) > 0
        return beta, 4 * 8 + 4 + (4 if beta else 0)

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self, s: Setup) -> None:
        from shardyard.data.pipeline import load_tokenizer

        b = s.backend
        self.backend, self.seed, self.shards = b, int(s.cfg.seed), s.shards
        # the ranks that sample different prompts: a sequence group's ranks read (and sample) the same
        readers: tuple[int, int] = s.shards.data_rank(b.dp_rank, b.dp_size) if s.shards else (b.dp_rank, b.dp_size)
        self.reader, self.readers = readers
        self.tok = load_tokenizer(s.tokenizer_dir)
        self.eos = self.tok.eos_token_id
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos
        hf = b.hf_model()
        self.policy: Any = hf  # a PeftModel when adapters train (disable_adapter)
        self.adapters = is_peft(hf)
        # The KL term's reference: the policy with its adapters off (LoRA), else a frozen copy placed as the policy.
        self.reference = b.reference_model(s.build) if self.beta > 0 and not self.adapters else None
        self._check_fields([s.train_rows, *s.val_rows.values()], b)
        dev = b.device
        self.one = torch.ones(1, device=dev)
        F = len(self.rewards)
        self.rollout_sums = torch.zeros(F + 5, device=dev, dtype=torch.float64)
        """Per reward its sum, then the total's sum, its square's, correct completions, completion tokens, completions."""
        self.loss_sums = torch.zeros(5, device=dev, dtype=torch.float64)
        """KL sum, low-clipped, high-clipped, region-clipped tokens, completion tokens."""
        self.gen_s, self.since = 0.0, time.perf_counter()
        install(hf, self)

    def _check_fields(self, splits: list, backend: Backend) -> None:
        """Every row of ``splits`` (the train rows, then each held-out source's) has the fields the rewards read and
        passes their ``check``. Each rank parses its strided share of every split (rows ``rank::world``: a 10^7-row
        set costs a rank 1/world of it), stopping at its first bad row; one all-reduce of a ``[splits, world]``
        table (each rank's first bad row in its own slot) tells every rank the first bad row of all, which every
        rank then checks again and raises with, the same ``UserError`` on every rank (``on_every_rank``)."""
        for rows in splits:
            if not hasattr(rows, "fields") or not hasattr(rows, "where"):
                raise UserError("data", type(rows).__name__, "GRPO samples completions of prompts: it needs prompt "
                                "rows.", "Use data=prompts (rows with a prompt and the fields the rewards need)."
                                ).on_every_rank()
        need = {f: fn.name for fn in self.rewards for f in fn.fields}
        if not need:
            return

        def problem(fields: dict) -> Optional[tuple[str, str]]:
            """What is wrong with a row, and the fix; None when the rewards can grade it."""
            missing = [f for f in need if f not in fields]
            if missing:
                return (f"The prompt has no field {missing[0]!r}, which the reward {need[missing[0]]} needs.",
                        f"Give every row the field {missing[0]!r}, or choose other objective.rewards.")
            for fn in self.rewards:  # e.g. an answer that is not one number: every completion would score 0
                why = fn.check(fields)
                if why:
                    return (f"The reward {fn.name} cannot grade this prompt: {why}.",
                            "Fix the row, or choose other objective.rewards.")
            return None

        rank, world = backend.rank, backend.world_size
        table = torch.zeros(len(splits), world, dtype=torch.float64)  # 1 + this rank's first bad row; 0: none
        for k, rows in enumerate(splits):
            for i in range(rank, len(rows), world):
                try:
                    bad = problem(rows.fields([i])[0]) is not None
                except Exception:  # a user's check that raised: every rank raises it below, at the first bad row
                    bad = True
                if bad:
                    table[k, rank] = i + 1
                    break
            if table[k, rank] > 0:
                break  # the error is in this split or an earlier one: the later splits need not be read
        # The minimum over ranks, with the one reduction every engine has (Horovod has no torch.distributed group):
        # all_reduce_mean x world sums the table, each slot written by one rank only, so every rank sees them all.
        table = (backend.all_reduce_mean(table.to(backend.device)) * world).round().cpu().long()
        for k, rows in enumerate(splits):
            firsts = table[k][table[k] > 0]
            if len(firsts):
                i = int(firsts.min()) - 1
                found = problem(rows.fields([i])[0]) or ("The rewards' check of this prompt failed on another rank.",
                                                        "Make the rewards' check give the same answer every time.")
                raise UserError("data.paths", rows.where([i])[0], *found).on_every_rank()

    def terms(self) -> int:
        return 1

    def factors(self, step: int) -> torch.Tensor:
        return self.one

    # --------------------------------------------------------------------------------------------- rollouts
    def micro_batches(self, step: int, accum: int, stream: Any, backend: Backend) -> list:
        r = step // self.num_iterations
        if self.buffer is None or self.round != r:
            self.buffer, self.round = self._rollouts(r, accum, stream, backend), r
        return self.buffer

    def _generate(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, *, greedy: bool, max_new: int,
                  generator: Optional[torch.Generator], backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        from shardyard.models.generation import generate

        with torch.no_grad(), moe.paused(model):
            return generate(model, ids, mask, max_new_tokens=max_new, temperature=0.0 if greedy else self.temperature,
                            top_k=self.top_k, top_p=self.top_p, eos_id=self.eos, pad_id=self.pad,
                            generator=generator, lockstep=backend.world_size > 1)

    def _rewards(self, comp: torch.Tensor, mask: torch.Tensor, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Each reward function's value per completion (``[F, B]``), and whether each completion is correct (every
        reward that checks a field of its row gives its full score)."""
        texts = self.tok.batch_decode([c[m.bool()].tolist() for c, m in zip(comp.cpu(), mask.cpu())],
                                      skip_special_tokens=True)
        try:
            values = torch.tensor([fn(texts, rows) for fn in self.rewards], dtype=torch.float64)
        except UserError as e:  # a user's reward raised or returned a non-number: every rank stops, not this one only
            self.failed = e
            values = torch.zeros(len(self.rewards), len(texts), dtype=torch.float64)
        checks = [i for i, fn in enumerate(self.rewards) if fn.fields]
        correct = (values[checks] >= 1).all(0) if checks else torch.zeros(len(texts), dtype=torch.bool)
        return values, correct

    def _rollouts(self, r: int, accum: int, stream: Any, backend: Backend) -> list:
        t0 = time.perf_counter()
        dev, G = backend.device, self.G
        model = backend.hf_model()
        was = model.training
        model.eval()
        made, totals = [], []
        weights = torch.tensor([fn.weight for fn in self.rewards], dtype=torch.float64)
        for micro in range(accum):
            x, rows = stream.micro_batch(r, micro)
            ids = x["prompt_ids"].to(dev).repeat_interleave(G, 0)
            pmask = x["prompt_mask"].to(dev).repeat_interleave(G, 0)
            g = torch.Generator(device=dev)
            g.manual_seed((((self.seed * 1_000_003 + r) * 65_537 + self.reader) * 257 + micro) % 2**62)
            comp, cmask = self._generate(model, ids, pmask, greedy=False, max_new=self.max_new_tokens, generator=g,
                                         backend=backend)
            if self.shards is not None:  # a sequence group trains on one set of completions: its first rank's
                comp, cmask = (sequence_parallel.from_first(t, self.shards) for t in (comp, cmask))
            values, correct = self._rewards(comp, cmask, [row for row in rows for _ in range(G)])
            total = (weights[:, None] * values).sum(0)
            totals.append(total)
            self.rollout_sums += torch.cat([values.sum(1), torch.stack([
                total.sum(), (total ** 2).sum(), correct.double().sum(), cmask.sum().double().cpu(),
                torch.tensor(float(len(total)), dtype=torch.float64)])]).to(dev)
            seq = torch.cat([ids, comp], 1)
            attn = torch.cat([pmask, cmask.to(pmask.dtype)], 1)
            targets = torch.where(cmask.bool(), comp, torch.full_like(comp, -100))
            made.append(({"input_ids": seq, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0)},
                         targets))
        model.train(was)
        self._agree(backend)
        advantages = self._advantages(torch.cat(totals), backend)
        for i, (x, _) in enumerate(made):
            n = len(totals[i])
            x["advantages"] = advantages[i * n:(i + 1) * n].to(dev, torch.float32)
        self.gen_s += time.perf_counter() - t0
        return made

    def _agree(self, backend: Backend) -> None:
        """A user's reward that failed on any rank stops every rank together (one small all-reduce per round),
        never one rank alone while the others wait in a collective: that rank prints its error, the others say so."""
        failed = torch.tensor([float(self.failed is not None)], device=backend.device)
        if backend.all_reduce_mean(failed).item() > 0:
            raise self.failed or UserError("objective.rewards", "(another rank's)", "A reward failed on another "
                                           "rank; its error is printed by that rank.", "See that error.")

    def _advantages(self, total: torch.Tensor, backend: Backend) -> torch.Tensor:
        """Group-relative advantages (``scale_rewards``): ``group`` and ``none`` within each group of G (this
        rank's own); ``batch`` divides by the standard deviation over the whole round, every rank's rewards."""
        if self.scale != "batch":
            return group_advantages(total, self.G, self.scale)
        centred = group_advantages(total, self.G, "none")
        moments = torch.stack([total.sum(), (total ** 2).sum(), torch.tensor(float(len(total)), dtype=torch.float64)])
        s, s2, n = (backend.all_reduce_mean(moments.to(backend.device)) * self.readers).tolist()  # replicas
        std = max((s2 - s * s / n) / max(n - 1, 1), 0.0) ** 0.5  # unbiased, as torch.std
        return centred / (std + 1e-4)

    # ------------------------------------------------------------------------------------------------- loss
    def counts(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.aggregation == "token":  # this rank's completion tokens (under sp/cp: of its share of the positions)
            n = (self._split(inputs, targets)[1] != -100).sum() if self.shards is not None else (targets != -100).sum()
        else:  # completions: a sequence group's rows counted once, by its first rank
            n = torch.tensor(targets.shape[0] if self.shards is None or self.shards.index == 0 else 0)
        return n.reshape(1).to(targets.device, torch.int64)

    def _split(self, x: dict, targets: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """A rollout micro-batch (prompt + completion rows, ``targets`` the completion's ``[B, M]``) as this rank's
        share of its positions under ``backend.sp`` / ``backend.cp``: the targets placed at the positions that
        predict them (``[B, P + M]``: position t predicts token t + 1), then cut (``sequence_parallel.shard``,
        the left padding masked by the rows' ``attention_mask``)."""
        assert self.shards is not None
        b, m = targets.shape
        ignore = targets.new_full((b, 1), -100)
        whole = torch.cat([ignore.expand(b, x["input_ids"].shape[1] - m - 1), targets, ignore], 1)
        return sequence_parallel.shard({k: x[k] for k in ("input_ids", "attention_mask", "position_ids")}, whole,
                                       self.shards)

    def _token_logps(self, model: Any, x: dict, targets: torch.Tensor) -> torch.Tensor:
        """Each completion token's log-probability (``[B, M]``; under sp/cp: ``x`` and ``targets`` a share of the
        rows' positions, ``_split``, and the log-probabilities of its positions' targets)."""
        from shardyard.models.loss import SEQUENCE_SHARDS, logits

        # The distribution the rollouts were sampled from (logits / objective.temperature), for the sampling policy,
        # the policy and the reference alike, as TRL scores them: the ratio and the KL are then of that distribution.
        if SEQUENCE_SHARDS in x:
            return token_logps(logits(model(**x)), targets, self.temperature)
        M = targets.shape[1]
        kwargs = {k: x[k] for k in ("input_ids", "attention_mask", "position_ids")}
        out = logits(model(**kwargs, logits_to_keep=M + 1))[:, :-1]  # the positions that predict the completion
        return token_logps(out, targets, self.temperature)

    def loss_sum(self, model: Any, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        x = inputs
        if self.shards is None:
            split, y, lengths = x, targets, None
        else:  # this rank's share of the positions; each completion's length is the whole row's
            (split, y), lengths = self._split(x, targets), (targets != -100).sum(-1)
        logps = self._token_logps(model, split, y)
        mask = y != -100
        if "old_logps" not in x:  # the round's first step: the policy that sampled, as its own forward computed it
            x["old_logps"] = logps.detach()
        ref = None
        if self.beta > 0:
            if "ref_logps" not in x:
                with torch.no_grad():
                    if self.reference is not None:
                        x["ref_logps"] = self._token_logps(self.reference, split, y)
                    else:
                        with self.policy.disable_adapter(), moe.paused(model):
                            x["ref_logps"] = self._token_logps(model, split, y)
            ref = x["ref_logps"]
        t = grpo_per_token(logps, x["old_logps"], ref, x["advantages"], mask, self.epsilon, self.epsilon_high,
                           self.beta, bias_correction_kl=self.bias_correction_kl)
        loss, _ = aggregate(t.loss, mask, self.aggregation, lengths)
        with torch.no_grad():
            m = mask.double()
            self.loss_sums += torch.stack([(t.kl.double() * m).sum(), (t.low_clipped.double() * m).sum(),
                                           (t.high_clipped.double() * m).sum(), (t.region_clipped.double() * m).sum(),
                                           m.sum()])
        return loss.float()

    def eval_loss(self, model: Any, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_sum(model, inputs, targets) / self.counts(inputs, targets)[0].clamp(min=1)

    # ---------------------------------------------------------------------------------------------- metrics
    def train_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        now = time.perf_counter()
        gen_share = torch.tensor([self.gen_s / max(now - self.since, 1e-9)], dtype=torch.float64,
                                 device=self.rollout_sums.device)
        sums = reduce(torch.cat([self.rollout_sums, self.loss_sums, gen_share])).tolist()
        self.rollout_sums.zero_()
        self.loss_sums.zero_()
        self.gen_s, self.since = 0.0, now
        F = len(self.rewards)
        out: dict[str, float] = {"train/generation_share": sums[-1]}
        kl, low, high, region, tokens = sums[F + 5:F + 10]
        if tokens > 0:
            out.update({"train/clip_ratio/low": low / tokens, "train/clip_ratio/high": high / tokens,
                        "train/clip_ratio/region": region / tokens})
            if self.beta > 0:
                out["train/kl"] = kl / tokens
        total, squares, correct, comp_tokens, n = sums[F:F + 5]
        if n > 0:  # a round was sampled since the last log step
            mean = total / n
            out.update({"train/reward": mean, "train/reward_std": max(squares / n - mean * mean, 0.0) ** 0.5,
                        "train/accuracy": correct / n, "train/completion_len": comp_tokens / n,
                        **{f"train/reward/{fn.name}": sums[i] / n for i, fn in enumerate(self.rewards)}})
        return out

    def evaluate(self, backend: Backend, val: dict, batches: int, micro_batch: int) -> Optional[dict[str, float]]:
        """Greedy completions of the held-out prompts: the mean reward (``eval/loss`` is its negative, so that early
        stopping and sweeps read lower as better), accuracy, each reward's mean, the completion length."""
        from shardyard.data.pipeline import eval_batches

        dev = backend.device
        model = backend.hf_model()
        was = model.training
        model.eval()
        F = len(self.rewards)
        sums = torch.zeros(F + 4, dtype=torch.float64)
        weights = torch.tensor([fn.weight for fn in self.rewards], dtype=torch.float64)
        for rows in val.values():
            for x, fields in eval_batches(rows, batches, micro_batch, backend.dp_rank, backend.dp_size):
                comp, cmask = self._generate(model, x["prompt_ids"].to(dev), x["prompt_mask"].to(dev), greedy=True,
                                             max_new=self.eval_max_new_tokens, generator=None, backend=backend)
                values, correct = self._rewards(comp, cmask, list(fields))
                sums += torch.cat([values.sum(1), torch.stack([(weights[:, None] * values).sum(), correct.double().sum(),
                                                               cmask.sum().double().cpu(),
                                                               torch.tensor(float(values.shape[1]), dtype=torch.float64)])])
        model.train(was)
        self._agree(backend)
        s = backend.all_reduce_mean(sums.to(dev)).tolist()
        n = max(s[-1], 1e-12)
        return {"eval/loss": -s[F] / n, "eval/reward": s[F] / n, "eval/accuracy": s[F + 1] / n,
                "eval/completion_len": s[F + 2] / n, **{f"eval/reward/{fn.name}": s[i] / n for i, fn in enumerate(self.rewards)}}

    # ------------------------------------------------------------------------------------------- checkpoint
    def save(self, path: str, rank: int, step: int) -> None:
        """The round's rollouts, when the checkpoint after ``step`` steps falls inside a round (``num_iterations`` >
        1): a resume there trains on the same completions, with the log-probs of the policy that sampled them."""
        if self.buffer is None or step // self.num_iterations != self.round:
            return
        from safetensors.torch import save_file

        d = os.path.join(path, STATE_DIR, f"rank{rank}")
        os.makedirs(d, exist_ok=True)
        tensors = {f"{i}.{k}": v.detach().cpu().contiguous() for i, (x, y) in enumerate(self.buffer)
                   for k, v in {**x, "targets": y}.items()}
        save_file(tensors, os.path.join(d, "rollouts.safetensors"))
        with open(os.path.join(d, "round.json"), "w") as f:
            json.dump({"round": self.round, "micro_batches": len(self.buffer), "dp_rank": self.backend.dp_rank,
                       "dp_size": self.backend.dp_size, "sequence_shards": self._sequence_shards()}, f)

    def _sequence_shards(self) -> list[Any]:
        """This rank's place in its sequence group (index, size, style): the kept log-probs are of its share."""
        s = self.shards
        return [s.index, s.size, s.style] if s is not None else [0, 1, None]

    def load(self, path: str, rank: int, same_world: bool) -> None:
        """A checkpoint inside a round, resumed at the layout that saved it: that round's rollouts back. At another
        world size or data-parallel layout the ranks' shares differ: the round is sampled again from the restored
        policy."""
        d = os.path.join(path, STATE_DIR, f"rank{rank}")
        if not same_world or not os.path.isfile(os.path.join(d, "round.json")):
            return
        from safetensors.torch import load_file

        with open(os.path.join(d, "round.json")) as f:
            meta = json.load(f)
        if (meta.get("dp_rank"), meta.get("dp_size")) != (self.backend.dp_rank, self.backend.dp_size) \
                or meta.get("sequence_shards", [0, 1, None]) != self._sequence_shards():
            return  # another data-parallel layout (fsdp_tp's tp changed, sp or cp did): this rank's share differs,
            # sample it again
        tensors = load_file(os.path.join(d, "rollouts.safetensors"), device=str(self.backend.device))
        buffer: list = [({}, None) for _ in range(meta["micro_batches"])]
        for key, t in tensors.items():
            i, name = key.split(".", 1)
            x, y = buffer[int(i)]
            if name == "targets":
                buffer[int(i)] = (x, t)
            else:
                x[name] = t
        self.buffer, self.round = buffer, meta["round"]
