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

