"""Derived metrics every engine reports the same way: achieved TFLOP/s, MFU and memory."""

from __future__ import annotations

import torch

# Dense (no sparsity) peak TFLOP/s per GPU from the vendors' data sheets. "tf32" applies to fp32 matmuls
# when TF32 is allowed, "fp32" when it is not (torch's default).
PEAK_TFLOPS = [  # (substring of torch.cuda.get_device_name(), {precision: peak}), most specific first
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM5 / HBM3
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
]


def peak_tflops(device: torch.device, precision: str, override: float | None) -> float | None:
    """Peak TFLOP/s of one device for MFU: the override, else the table; None when unknown (e.g. CPU)."""
    if override is not None:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        precision = "tf32"
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            return peaks[precision]
    return None


def measured_peak_tflops(device: torch.device, precision: str, n: int | None = None, seconds: float = 1.0) -> float:
    """The matmul TFLOP/s this device reaches, measured: the best of repeated ``n x n`` matmuls in the
    precision's dtype (bf16/fp16; fp8 runs its bf16 fallback's figure; fp32 as the matmul setting allows).
    MFU against this is the fraction of what the device really does here, which the data-sheet table
    (``peak_tflops``) overstates (clock and power limits, a shared CPU). ``n``: 8192 on GPUs, 1024 on CPU."""
    import time

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(precision, torch.float32)
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.matmul(a, b)  # warm-up: kernel selection, lazy init
    sync()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        reps = 10 if device.type == "cuda" else 1
        t = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        best = min(best, (time.perf_counter() - t) / reps)
    return 2 * n ** 3 / best / 1e12


def memory_metrics(device: torch.device) -> dict:
    """CUDA: peak allocated and reserved GiB since the last call (then the peaks are reset); CPU: RSS."""
    gib = 1024 ** 3
    if device.type == "cuda":
        out = {"memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
               "memory/max_reserved_gib": torch.cuda.max_memory_reserved(device) / gib}
        _RUN_PEAK["cuda"] = max(_RUN_PEAK["cuda"], torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return out
    import psutil

    return {"memory/rss_gib": psutil.Process().memory_info().rss / gib}


_RUN_PEAK = {"cuda": 0}


def reset_host_peak() -> None:
    """Start the resident high-water mark (``VmHWM``) afresh (Linux ``clear_refs``): what a run measures beside the
    plan is its training's peak, not the data preparation's before it (a first run builds its tokenizer and
    token cache in the same process). A kernel that refuses leaves the mark as it is."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def run_peak_memory(device: torch.device) -> float:
    """This process's peak over the whole run, in bytes: CUDA's ``max_memory_allocated`` (across the
    per-interval resets above), or on CPU the resident high-water mark (``VmHWM``)."""
    if device.type == "cuda":
        return float(max(_RUN_PEAK["cuda"], torch.cuda.max_memory_allocated(device)))
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    return float("nan")

