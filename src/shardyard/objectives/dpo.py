"""``objective=dpo``: direct preference optimisation on ``data=preference`` pairs (Rafailov et al. 2023), with
the IPO (Azar et al. 2023) and hinge (SLiC) variants of the loss, as TRL's ``DPOTrainer`` computes them.

    python train.py objective=dpo data=preference model.weights=outputs/.../hf
    python train.py recipe=dpo_tiny

A step's loss is the mean over its preference pairs (every micro-batch and rank: ``counts`` is the pairs) of
``-log sigmoid(beta x ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))`` (sigmoid), each sequence's
log-probability summed over its response tokens (IPO: their mean, as TRL). The reference is the policy at its
starting weights, frozen: with LoRA/QLoRA the same model with its adapters disabled (no second copy); otherwise
``Backend.reference_model``, sharded as the engine shards the policy (FSDP its own ``fully_shard``, ZeRO-3
partitioned without an optimizer). Its forward runs under ``no_grad`` inside the engine's own autocast, so at step
0 the two agree bit for bit and the loss is log 2.

``objective.precompute_ref_logps=true``: the reference's log-probabilities of every pair are computed once, before
the first step, and kept in a cache keyed like the token caches (the token arrays, the reference's weights and
config, the precision) and verified like them (every file's size and sha256): later runs of the same data and
reference read them and never build the reference model (``RefCache``).

``backend.sp`` / ``backend.cp``: the ranks of a sequence group read the same pairs and each runs its share of the
positions of every chosen and rejected row (``sequence_parallel.shard``), the policy's and the reference's forward
alike; a response's log-probability is the sum of the shares' sums over the group (``sequence_parallel.sequence_sum``),
so every rank computes the whole pairs' loss, and each share's gradient flows back through its own positions.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Optional

import numpy as np
import torch

from shardyard.models import moe
from shardyard.models.adapters import is_peft
from shardyard.backends import Backend, sequence_parallel
from shardyard.backends.reference import release as release_reference
from shardyard.core.errors import UserError
from shardyard.objectives import Setup, install, pairs, to_device
from shardyard.objectives.losses import dpo_loss, token_logps

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
"""Means over the pairs, named as TRL logs them (``train/`` or ``eval/`` before each)."""


class DPO:
    data_kind = "preference"
    """The rows it trains on (a data option's ``kind``), checked at validation."""
    loss_falls = True
    """The loop's warnings on a flat or oscillating train loss apply: the preference loss falls as the margins grow."""
    splits_sequences = True
    """Under ``backend.sp`` / ``backend.cp`` it cuts its own pairs into the rank's share of their positions
    (``_split``)."""

    def __init__(self, name: str = "dpo", beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 reference_weights: Optional[str] = None, precompute_ref_logps: bool = False):
        if not beta > 0:
            raise UserError("objective.beta", beta, "DPO's beta scales the log-ratio of policy and reference; it "
                            "must be above 0 (IPO divides by it).", "Use e.g. objective.beta=0.1.")
        if loss_type not in LOSS_TYPES:
            raise UserError("objective.loss_type", loss_type, "Unknown DPO loss.", f"Use one of {list(LOSS_TYPES)}.")
        if not 0 <= label_smoothing < 0.5:
            raise UserError("objective.label_smoothing", label_smoothing, "It is the assumed share of flipped "
                            "preference labels, in [0, 0.5).", "Use 0 (plain DPO) or e.g. 0.1.")
        self.name, self.beta, self.loss_type, self.label_smoothing = name, beta, loss_type, label_smoothing
        self.precompute = precompute_ref_logps
        self.reference_weights = reference_weights  # read by Backend.reference_model (backends.reference.options)
        self.reference: Optional[torch.nn.Module] = None
        self.cached: dict[str, np.ndarray] = {}
        """``precompute_ref_logps``: each split's reference log-probs (summed over the response), ``[pairs, 2]``."""
        self.cache_built = False
        """``precompute_ref_logps``: this run computed them (and built the reference for it, then freed it)."""
        self.sums: dict[str, torch.Tensor] = {}
        self.shards: Optional[sequence_parallel.Shards] = None

    @staticmethod
    def sequences(o: Any, seq_len: int) -> tuple[int, int]:
        """Per preference pair: the chosen and the rejected row (``objectives.sequences``)."""
        return 2, seq_len

    @staticmethod
    def held(o: Any) -> tuple[bool, float]:
        """A reference model (none while training when its log-probs are precomputed), no rollouts
        (``objectives.held``)."""
        return not bool(o.get("precompute_ref_logps")), 0.0

    def setup(self, s: Setup) -> None:
        hf = s.backend.hf_model()
        self.adapters = is_peft(hf)
        self.policy: Any = hf  # a PeftModel when adapters train (disable_adapter)
        dev = s.backend.device
        self.sums = {"train": torch.zeros(len(METRICS) + 1, device=dev), "eval": torch.zeros(len(METRICS) + 1, device=dev)}
        self._one = torch.ones(1, device=dev)
        self.shards = s.shards
        install(hf, self)
        if self.precompute:
            self.cached = RefCache(self, s).splits()
        elif not self.adapters:  # LoRA/QLoRA: the policy with its adapters disabled; else a frozen copy placed as the policy
            self.reference = s.backend.reference_model(s.build)

    def terms(self) -> int:
        return 1

    def micro_batches(self, step: int, accum: int, stream: Any, backend: Backend) -> list:
        dev = backend.device
        out = []
        for micro in range(accum):
            x, y = stream.micro_batch(step, micro)
            if self.cached:  # the pairs' precomputed reference log-probs, by their row in the split
                rows = stream.samples.sample_ids(stream.indices(step, micro))
                x = {**x, "ref_logps": torch.from_numpy(self.cached["train"][rows])}
            out.append((to_device(x, dev), y.to(dev, non_blocking=True)))
        return out

    def counts(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor([targets.shape[0]], dtype=torch.int64, device=targets.device)  # preference pairs

    def factors(self, step: int) -> torch.Tensor:
        return self._one

    def _logps(self, model: Any, inputs: dict, targets: torch.Tensor, mean: bool = True,
               tokens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's log-probability over its response tokens (IPO: their mean, unless ``mean`` is off):
        chosen, rejected. ``inputs``: whole rows, or this rank's share of their positions (``_split``), whose sums
        are then added over the sequence group; ``tokens``: each row's response tokens (IPO's mean), counted on the
        whole rows (default: on ``targets``)."""
        from shardyard.models.loss import SEQUENCE_SHARDS, _call, logits

        per_token = token_logps(logits(_call(model, {k: v for k, v in inputs.items() if k != "ref_logps"})), targets)
        lp = per_token.sum(-1)
        if SEQUENCE_SHARDS in inputs:  # the whole sequence's sum, every share's gradient its own positions'
            lp = sequence_parallel.sequence_sum(lp, inputs[SEQUENCE_SHARDS].shards)
        if self.loss_type == "ipo" and mean:
            lp = lp / (tokens if tokens is not None else (targets != -100).sum(-1)).clamp(min=1)
        half = lp.shape[0] // 2
        return lp[:half], lp[half:]

    def _reference_logps(self, model: Any, inputs: dict, targets: torch.Tensor, tokens: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        if "ref_logps" in inputs:  # precomputed (summed over the response; IPO: their mean)
            lp = inputs["ref_logps"].float()
            if self.loss_type == "ipo":
                lp = lp / tokens.clamp(min=1)
            half = lp.shape[0] // 2
            return lp[:half], lp[half:]
        with torch.no_grad():
            if self.reference is not None:
                return self._logps(self.reference, inputs, targets, tokens=tokens)
            # The policy with its adapters off; MoE routers neither count these tokens nor add a balance loss.
            with self.policy.disable_adapter(), moe.paused(model):
                return self._logps(model, inputs, targets, tokens=tokens)

    def _split(self, flat: dict, targets: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The pairs' rows (``objectives.pairs``) as this rank's share of their positions under ``backend.sp`` /
        ``backend.cp`` (``sequence_parallel.shard``; precomputed reference log-probs, one per row, as they are);
        unchanged without."""
        if self.shards is None:
            return flat, targets
        rows = {k: v for k, v in flat.items() if k in ("input_ids", "position_ids")}
        x, y = sequence_parallel.shard(rows, targets, self.shards)
        return {**x, **{k: v for k, v in flat.items() if k not in rows}}, y

    def _loss(self, model: Any, inputs: Any, targets: torch.Tensor, mode: str) -> torch.Tensor:
        flat, y = pairs(inputs, targets)
        tokens = (y != -100).sum(-1)
        x, y = self._split(flat, y)
        ref_c, ref_r = self._reference_logps(model, x, y, tokens)
        pol_c, pol_r = self._logps(model, x, y, tokens=tokens)
        losses, chosen, rejected = dpo_loss(pol_c, pol_r, ref_c, ref_r, self.beta, self.loss_type,
                                            self.label_smoothing)
        with torch.no_grad():
            self.sums[mode] += torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(),
                                            (chosen - rejected).sum(), pol_c.sum(), pol_r.sum(),
                                            torch.tensor(float(len(losses)), device=losses.device)]).float()
        return losses.float().sum()

    def loss_sum(self, model: Any, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(model, inputs, targets, "train")

    def eval_loss(self, model: Any, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(model, inputs, targets, "eval") / targets.shape[0]

    def _metrics(self, mode: str, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        sums = reduce(self.sums[mode]).tolist()
        self.sums[mode].zero_()
        n = max(sums[-1], 1e-12)
        return {f"{mode}/{k}": v / n for k, v in zip(METRICS, sums)}

    def train_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        return self._metrics("train", reduce)

    def evaluate(self, backend: Backend, val: dict, batches: int, micro_batch: int) -> Optional[dict[str, float]]:
        """The loop's held-out loss (the mean DPO loss over the val pairs) and the pairs' reward metrics."""
        from shardyard.data.pipeline import eval_batches

        model = backend.hf_model()
        was = model.training
        model.eval()
        total = torch.zeros(2, device=backend.device)
        # a sequence group's ranks read the same pairs (each its share of their positions: _split)
        reader, readers = self.shards.data_rank(backend.dp_rank, backend.dp_size) if self.shards \
            else (backend.dp_rank, backend.dp_size)
        for rows in val.values():
            for b, (x, y) in enumerate(eval_batches(rows, batches, micro_batch, reader, readers)):
                if self.cached:  # the rows eval_batches read: the first batches x micro x readers, by reader
                    first = (b * readers + reader) * micro_batch
                    x = {**x, "ref_logps": torch.from_numpy(self.cached["val"][[(first + i) % len(rows)
                                                                                for i in range(micro_batch)]])}
                n = y.shape[0]
                total += torch.stack([backend.eval_loss(to_device(x, backend.device), y.to(backend.device)).float() * n,
                                      torch.tensor(float(n), device=backend.device)])
        model.train(was)
        loss_sum, n = backend.all_reduce_mean(total).tolist()
        return {"eval/loss": loss_sum / max(n, 1e-12), **self._metrics("eval", backend.all_reduce_mean)}

    def save(self, path: str, rank: int, step: int) -> None:
        pass

    def load(self, path: str, rank: int, same_world: bool) -> None:
        pass



class RefCache:
    """``objective.precompute_ref_logps``: the reference's log-probability of every pair's chosen and rejected
    response (summed over its tokens), for the train and val splits, computed once and cached.

    1. Keyed like the token caches (``token_cache.cache_key``): the token arrays' directory (itself keyed by the
       data, its settings and the tokenizer), the model config, the reference's weights (``model.weights``: every
       file's name, size and mtime; a fresh init: the seed) and the precision. Published with a manifest and
       verified like them (``data.verify``): a damaged cache is rebuilt, saying so, never used.
    2. Built by every data-parallel replica on its share of the rows, the same number of micro-batches on every
       rank (a sharded reference runs collectives in its forward), then summed over the replicas (one all-reduce
       of ``[pairs, 2]`` values per split) and written by rank 0; the others wait at a barrier.
    3. A run that finds it never builds the reference model: its memory is the policy's alone."""

    def __init__(self, dpo: DPO, s: Setup):
        from shardyard.data.token_cache import cache_key, verify_mode

        self.dpo, self.s, self.b = dpo, s, s.backend
        if len(s.val_rows) != 1 or not hasattr(s.train_rows, "prefix"):
            raise UserError("objective.precompute_ref_logps", True, "It keeps the reference log-probs of one "
                            "preference source's rows, by row.", "Use one data=preference source, or "
                            "objective.precompute_ref_logps=false.").on_every_rank()
        self.rows = {"train": s.train_rows, "val": next(iter(s.val_rows.values()))}
        tokens = os.path.basename(os.path.dirname(s.train_rows.prefix))
        self.out = os.path.join(s.cfg.data.cache_dir, "ref_logps", cache_key("ref_logps", 0.0, tokens, self._reference()))
        self.verify = verify_mode(s.cfg.data)

    def _reference(self) -> str:
        from omegaconf import OmegaConf

        from shardyard.models.weights import weights_dir

        cfg = self.s.cfg

        def files(d: Optional[str]) -> Any:
            return [(f, os.path.getsize(os.path.join(d, f)), os.stat(os.path.join(d, f)).st_mtime_ns)
                    for f in sorted(os.listdir(d))] if d else None

        what = {"model": OmegaConf.to_container(cfg.model, resolve=True),
                "weights": files(weights_dir(cfg.model)) or f"init seed {cfg.seed}",
                "reference_weights": files(self.dpo.reference_weights), "precision": cfg.precision.name,
                # with adapters the reference is the base they sit on (QLoRA: quantised)
                "peft": OmegaConf.to_container(cfg.peft, resolve=True) if self.dpo.adapters else None}
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()

    def splits(self) -> dict[str, np.ndarray]:
        from shardyard.data.token_cache import cache_problem

        found = torch.tensor([float(cache_problem(self.out, self.verify) is None)], device=self.b.device)
        if self.b.all_reduce_mean(found).item() < 1:  # every rank builds it together (a sharded reference)
            self._build()
        elif self.b.rank == 0:
            print(f"shardyard | DPO: the reference log-probs of every pair from {self.out}: no reference model built",
                  flush=True)
        return {split: np.load(os.path.join(self.out, f"{split}.npy")) for split in self.rows}

    def _build(self) -> None:
        import math
        import tempfile

        from shardyard.objectives import pairs
        from shardyard.data.token_cache import _locked, publish

        b, dpo = self.b, self.dpo
        dpo.cache_built = True
        reference = None if dpo.adapters else b.reference_model(self.s.build)
        model = b.hf_model()
        mb = int(self.s.cfg.train.micro_batch_size)
        was = model.training
        model.eval()
        computed = {}
        for split, rows in self.rows.items():
            n = len(rows)
            share = math.ceil(n / b.dp_size)
            values = torch.zeros(n, 2, device=b.device)
            for k in range(math.ceil(share / mb)):  # 2
                want = [b.dp_rank * share + k * mb + i for i in range(mb)]
                mine = [i for i in want if i < min(n, (b.dp_rank + 1) * share)]
                x, y = rows.get([*mine, *[0] * (mb - len(mine))])  # padded: every rank runs as many forwards
                flat, fy = pairs(to_device(x, b.device), y.to(b.device))
                with torch.no_grad():
                    if reference is not None:
                        c, r = dpo._logps(reference, flat, fy, mean=False)
                    else:
                        with dpo.policy.disable_adapter(), moe.paused(model):
                            c, r = dpo._logps(model, flat, fy, mean=False)
                if mine:
                    values[mine] = torch.stack([c, r], 1)[:len(mine)].float()
            computed[split] = (b.all_reduce_mean(values.double()) * b.dp_size).float().cpu().numpy()
        model.train(was)
        if b.rank == 0:
            with _locked(self.out + ".lock"):
                os.makedirs(os.path.dirname(self.out), exist_ok=True)
                tmp = tempfile.mkdtemp(dir=os.path.dirname(self.out), prefix=".tmp-ref-")
                for split, arr in computed.items():
                    np.save(os.path.join(tmp, f"{split}.npy"), arr)
                publish(tmp, self.out, self.verify)
            print(f"shardyard | DPO: the reference log-probs of {sum(map(len, computed.values())):,} pairs cached "
                  f"in {self.out}", flush=True)
        b.barrier()
        release_reference(b)  # 3: the training holds the policy alone
