# python bench/moe_balance.py RUN_DIR [RUN_DIR ...]    (per-layer expert load of each run's HF export on held-out text)
"""Routes the run's own held-out (val) sequences through its exported model and prints, per MoE layer, the
busiest and idlest expert's load against the mean and the experts that got no token, beside the run's final eval
loss. The README's MoE section is made with it:

    python train.py model=deepseek_moe_tiny backend=single train.steps=150 model.balance.bias_update_speed=0 \
        model.balance.seq_aux_alpha=0 hydra.run.dir=outputs/moe_off
    python train.py model=deepseek_moe_tiny backend=single train.steps=150 hydra.run.dir=outputs/moe_on
    python bench/moe_balance.py outputs/moe_off outputs/moe_on
"""
import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from shardyard.data import pipeline as data
from shardyard.models import moe


def main(run_dir: str, batches: int = 16) -> None:
    from transformers import AutoModelForCausalLM

    cfg = OmegaConf.load(Path(run_dir, "config.yaml"))
    val = data.open_split(data.prepare(cfg), "val", cfg.data.seq_len)
    model = AutoModelForCausalLM.from_pretrained(str(Path(run_dir, "hf")), local_files_only=True, dtype=torch.float32)
    ids = (x for x, _ in data.eval_batches(val, batches, cfg.train.micro_batch_size, 0, 1))
    loads = moe.held_out_loads(model, ids)
    summary = json.loads(Path(run_dir, "summary.json").read_text())
    b = cfg.model.balance
    print(f"{run_dir}: {cfg.model.name}, {summary['steps']} steps, bias_update_speed={b.bias_update_speed:g} "
          f"seq_aux_alpha={b.seq_aux_alpha:g}; final eval loss {summary['eval_losses'][-1][1]:.4f}; held-out "
          f"routing over {batches * cfg.train.micro_batch_size} sequences of {cfg.data.seq_len} tokens:")
    for layer, load in sorted(loads.items()):
        hi, lo, dead = moe.imbalance(load)
        share = ", ".join(f"{100 * v / load.sum():.0f}%" for v in load)
        print(f"  layer {layer}: max/mean {hi:.2f}  min/mean {lo:.2f}  experts without a token {dead}  ({share})")


if __name__ == "__main__":
    for d in sys.argv[1:]:
        main(d)
