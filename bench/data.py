"""python bench/data.py [--mb 40] [--buffer-mb 4]

The data layer's throughput and memory on this machine, on a generated JSONL corpus (``testing.synthetic_corpus``):

1. the ceiling: HF ``tokenizers`` ``encode_batch_fast`` over the corpus's texts, already in memory, on one core
   (TOKENIZERS_PARALLELISM=false) and on all (its own Rayon threads);
2. shardyard's token-cache build (``shardyard data``: read, split, tokenize, write shards) with data.num_proc=1
   and = the cores, tokenizer already trained, as MB of text per second and per core, beside the ceiling;
3. peak memory of the whole build (summed PSS of the main process and its tokenizer processes, every 20 ms)
   for a corpus 1x and 10x data.buffer_mb: it must not grow with the corpus;
4. the data-loading share of a training step: ``data_time_s / step_time_s`` of the default recipe (30 steps,
   from its metrics.jsonl), and the time to read one step's batches from a 2 GB token corpus (random tokens
   written as shards, the page cache dropped), as a share of the default recipe's step time, with and
   without the next step's windows prefetched.

Prints; asserts nothing (timings belong here, not in tests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from shardyard.testing import peak_tree_rss, synthetic_corpus  # noqa: E402


def build(corpus: str, cache: str, num_proc: int, buffer_mb: int, tokenizer: str | None = None) -> tuple[int, float]:
    """``shardyard data`` in its own process: (peak memory, wall s). ``tokenizer``: a trained one (so the
    measured build only tokenizes)."""
    cmd = [sys.executable, "-m", "shardyard", "data", "data=text_files", f"data.paths=[{corpus}]",
           "data.tokenizer.vocab_size=4096", "data.tokenizer.train_bytes=4000000", f"data.num_proc={num_proc}",
           f"data.buffer_mb={buffer_mb}", f"data.cache_dir={cache}"]
    if tokenizer:
        cmd.append(f"data.tokenizer.path={tokenizer}")
    peak, wall, proc = peak_tree_rss(cmd, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    return peak, wall


def drop_tokens(cache: str) -> None:
    shutil.rmtree(os.path.join(cache, "tokens"), ignore_errors=True)


def data_share(tmp: str, gb: float) -> None:
    import numpy as np

    from shardyard.data import pipeline as data

    run = f"{tmp}/run"
    subprocess.run([sys.executable, "train.py", f"hydra.run.dir={run}", "train.steps=30", "train.eval_every_n_steps=0",
                    "train.sample_tokens=0", "checkpoint.save_final=false", "monitor=[console]"], cwd=ROOT, check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl") if "data_time_s" in line][2:]  # warm
    step_s = float(np.mean([r["step_time_s"] for r in rows]))
    dt = float(np.mean([r["data_time_s"] for r in rows]))
    print(f"default recipe (python train.py, 30 steps): data_time_s {dt * 1e3:.2f} ms of step_time_s "
          f"{step_s * 1e3:.0f} ms = {100 * dt / step_s:.2f}% (goal <= 2%)")
    from shardyard.testing import compose

    cfg = compose([])
    tokens = f"{tmp}/tokens2g"
    os.makedirs(tokens)
    per = 256 << 20  # 256 MiB shards, as data.shard_mb's default
    n_shards = int(gb * 1e9 // per)
    rng = np.random.default_rng(0)
    shards = []
    for i in range(n_shards):
        rng.integers(0, 4096, size=per // 2, dtype=np.uint16).tofile(f"{tokens}/train-{i:05d}.bin")
        shards.append({"file": f"train-{i:05d}.bin", "tokens": per // 2})
    seqs = data.PackedSequences(data.shards.TokenShards(tokens, shards, "uint16"), cfg.data.seq_len)
    gbs, mbs = 16, cfg.train.micro_batch_size
    for prefetch in (False, True):
        os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")  # cold pages where the OS lets us
        stream = data.TrainStream(seqs, prefetch, gbs, mbs, 0, 1)  # another seed: other windows each time
        if not prefetch:
            stream.samples.prefetch = lambda ks: None  # what reading costs without the kernel's read-ahead
        reads = []
        for step in range(40):
            t = time.perf_counter()
            for m in range(gbs // mbs):
                stream.micro_batch(step, m)
            reads.append(time.perf_counter() - t)
            time.sleep(step_s)  # the step's compute, during which the next step's windows are read
        fetch = float(np.median(reads))
        print(f"{n_shards * per / 1e9:.1f} GB token corpus ({len(seqs):,} sequences of {cfg.data.seq_len}), cold page "
              f"cache, {'with' if prefetch else 'without'} the next step's windows prefetched (MADV_WILLNEED): one "
              f"step's batches read in {fetch * 1e3:.2f} ms = {100 * fetch / step_s:.2f}% of the default step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=40.0, help="corpus size (MB of JSONL)")
    ap.add_argument("--buffer-mb", type=int, default=4)
    ap.add_argument("--corpus-gb", type=float, default=2.0, help="the token corpus read in part 4")
    ap.add_argument("--only-share", action="store_true", help="part 4 only")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        if args.only_share:
            return data_share(tmp, args.corpus_gb)
        big, small, cache = f"{tmp}/big/corpus.jsonl", f"{tmp}/small/corpus.jsonl", f"{tmp}/cache"
        os.makedirs(os.path.dirname(big))
        os.makedirs(os.path.dirname(small))
        synthetic_corpus(big, args.mb)
        synthetic_corpus(small, args.buffer_mb, seed=1)
        texts = [json.loads(line)["text"] for line in open(big)]
        mb = sum(len(t.encode()) for t in texts) / 1e6

        build(big, cache, 1, args.buffer_mb)  # trains the tokenizer (not timed below)
        import glob

        tok_file = glob.glob(f"{cache}/tokenizers/*/tokenizer.json")[0]
        ceiling = {}
        for parallel in ("false", "true"):
            code = ("import json, os, sys, time; from tokenizers import Tokenizer; "
                    f"t = Tokenizer.from_file({tok_file!r}); x = [json.loads(l)['text'] for l in open({big!r})]; "
                    "s = time.perf_counter(); [t.encode_batch_fast(x[i:i + 64], add_special_tokens=False) "
                    "for i in range(0, len(x), 64)]; print(time.perf_counter() - s)")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 env={**os.environ, "TOKENIZERS_PARALLELISM": parallel}).stdout
            ceiling[parallel] = mb / float(out.strip().splitlines()[-1])
        print(f"corpus {mb:.1f} MB of text ({len(texts):,} documents), {cores} cores, data.buffer_mb={args.buffer_mb}")
        print(f"HF tokenizers encode_batch_fast ceiling: {ceiling['false']:.2f} MB/s on 1 core, "
              f"{ceiling['true']:.2f} MB/s on {cores} (Rayon)")
        from shardyard.data import pipeline as data
        from shardyard.testing import compose

        for n in sorted({1, cores}):
            drop_tokens(cache)
            cfg = compose(["data=text_files", f"data.paths=[{big}]", "data.tokenizer.vocab_size=4096",
                           "data.tokenizer.train_bytes=4000000", f"data.num_proc={n}", f"data.buffer_mb={args.buffer_mb}",
                           f"data.cache_dir={cache}"])
            t = time.perf_counter()
            data.prepare(cfg)  # the tokenizer is cached: reading, tokenizing, writing (and the pool's start)
            rate = mb / (time.perf_counter() - t)
            used = cores if n == 1 else n  # one process tokenizes with the tokenizer's own Rayon threads
            print(f"shardyard token-cache build, data.num_proc={n}: {rate:.2f} MB/s on {used} cores = {rate / used:.2f} "
                  f"MB/s per core ({rate / ceiling['true' if n == 1 else 'false'] / (1 if n == 1 else n):.2f}x the "
                  f"ceiling for {'Rayon on all cores' if n == 1 else 'one core per process'})")
        for n in sorted({1, cores}):
            drop_tokens(cache)
            peak_small, _ = build(small, cache, n, args.buffer_mb, os.path.dirname(tok_file))
            drop_tokens(cache)
            peak_big, _ = build(big, cache, n, args.buffer_mb, os.path.dirname(tok_file))
            print(f"peak memory (PSS), data.num_proc={n}: corpus 1x the buffer {peak_small / 2**20:.0f} MiB, "
                  f"{args.mb / args.buffer_mb:.0f}x {peak_big / 2**20:.0f} MiB (ratio {peak_big / peak_small:.2f})")
        data_share(tmp, args.corpus_gb)


if __name__ == "__main__":
    main()
