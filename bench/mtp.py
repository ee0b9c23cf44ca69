# python bench/mtp.py RUN_DIR_WITH_MTP RUN_DIR_WITHOUT_MTP    (DeepSeek-V3's MTP: its loss beside the main loss)
"""Prints the MTP run's main and MTP (depth 1) train losses at every log step and both runs' eval losses, and the
ratio of the final main eval losses (MTP / without). docs/deepseek_v3.md's figures are made with it:

    python train.py recipe=deepseek_v3_mtp_tiny hydra.run.dir=outputs/mtp_on
    python train.py recipe=deepseek_v3_mtp_tiny model.mtp.depth=0 hydra.run.dir=outputs/mtp_off
    python bench/mtp.py outputs/mtp_on outputs/mtp_off

The MTP loss is the depth's own cross-entropy (predicting token i+2), logged as ``train/mtp_loss_1`` in every
monitor; the eval loss is the main model's only (MTP is a training objective)."""
import json
import sys
from pathlib import Path


def metrics(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines() if line.strip()]


def main(on: str, off: str) -> None:
    rows_on, rows_off = metrics(on), metrics(off)
    train_off = {m["step"]: m["train/loss"] for m in rows_off if "train/loss" in m}
    print(f"{'step':>5} {'main (MTP run)':>15} {'MTP depth 1':>12} {'weight':>7} {'main (no MTP)':>14}")
    for m in rows_on:
        if "train/loss" in m:
            print(f"{m['step']:>5} {m['train/loss']:>15.4f} {m['train/mtp_loss_1']:>12.4f} {m['train/mtp_weight']:>7.2f} "
                  f"{train_off.get(m['step'], float('nan')):>14.4f}")
    evals_on = [(m["step"], m["eval/loss"]) for m in rows_on if "eval/loss" in m]
    evals_off = dict((m["step"], m["eval/loss"]) for m in rows_off if "eval/loss" in m)
    print(f"\n{'step':>5} {'eval, MTP run':>14} {'eval, no MTP':>13}")
    for step, loss in evals_on:
        print(f"{step:>5} {loss:>14.4f} {evals_off.get(step, float('nan')):>13.4f}")
    last = evals_on[-1]
    print(f"\nfinal main eval loss: {last[1]:.4f} with MTP, {evals_off[last[0]]:.4f} without "
          f"(ratio {last[1] / evals_off[last[0]]:.4f})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
