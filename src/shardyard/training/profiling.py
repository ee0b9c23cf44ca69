"""``profile.enabled=true profile.steps=[a,b]``: a torch.profiler Chrome trace of steps a..b, per rank."""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig


class StepProfiler:
    def __init__(self, p: DictConfig, run_dir: str, rank: int, device: torch.device):
        """``p``: the run's ``profile`` section; the trace goes to ``profile.dir``, else ``<run_dir>/profile``."""
        self.enabled = p.enabled
        self.first: int = p.steps[0] if p.enabled else 0
        self.last: int = p.steps[1] if p.enabled else -1
        self.path = os.path.join(p.dir or os.path.join(run_dir, "profile"), f"rank{rank}.trace.json")
        self.prof: torch.profiler.profile | None = None
        if self.enabled:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=p.record_shapes,
                                               profile_memory=p.profile_memory, with_stack=p.with_stack)

    def before_step(self, step: int) -> None:
        """``step`` is 1-based, as in the logs."""
        if self.prof is not None and self.enabled and step == self.first:
            self.prof.start()

    def after_step(self, step: int) -> None:
        if self.prof is not None and self.enabled and step == self.last:
            self.prof.stop()
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.prof.export_chrome_trace(self.path)
            print(f"shardyard | profile of steps {self.first}-{self.last} -> {self.path}", flush=True)
            self.enabled = False
