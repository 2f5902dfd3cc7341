"""What one bench run measures besides its tokens: when tokens arrive at a streamer (time to first token and the
gaps between tokens) and the peak memory."""

from __future__ import annotations

import os
import time

import torch
from transformers.generation.streamers import BaseStreamer


class ArrivalStreamer(BaseStreamer):
    """Records when generated tokens arrive; the first `put` (the prompt) is skipped."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int]] = []  # (time, tokens arriving together)
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.arrivals.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif os.path.exists("/proc/self/clear_refs"):
        try:  # Linux: writing 5 resets the resident-set high-water mark (VmHWM)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def peak_memory_mb(device: torch.device) -> float | None:
    """CUDA: peak allocated tensor memory. CPU (Linux): the process's resident high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def latencies(arrivals: list[tuple[float, int]]) -> tuple[float | None, list[float]]:
    """Time to first token and per-token inter-arrival gaps (0 for tokens that arrive with the one before)."""
    if not arrivals:
        return None, []
    gaps, previous = [], arrivals[0][0]
    for t, k in arrivals[1:]:
        gaps.extend([t - previous] + [0.0] * (k - 1))
        previous = t
    gaps = [0.0] * (arrivals[0][1] - 1) + gaps
    return arrivals[0][0], gaps
