"""Copies between device memory and the host pool, and how to know they are done.

CUDA: each direction has its own stream; a copy returns an event recorded after it. See
NOTE [offload runtime] in offload.py for when a stream waits on another. CPU: a copy is
a plain synchronous memcpy, done when it returns.
"""

from __future__ import annotations

import time

import torch


class Copies:
    """Device<->host copies for one device, with the time the host spent waiting on them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.wait_s = 0.0  # host time spent blocked on copies (on-demand fetches, forced completions)
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.offload_stream = torch.cuda.Stream(device)
            self.prefetch_stream = torch.cuda.Stream(device)

    def to_host(self, source: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event | None:
        """Copy ``source`` (uint8, on the device) into ``host``; returns a completion token."""
        self.d2h_bytes += source.numel()
        if not self.cuda:
            host.copy_(source)
            return None
        self.offload_stream.wait_stream(self.compute)  # the copy sees what compute has written
        with torch.cuda.stream(self.offload_stream):
            host.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.offload_stream)
        return done

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A new device buffer filled from ``host``, and its completion token."""
        self.h2d_bytes += host.numel()
        target = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        if not self.cuda:
            target.copy_(host)
            return target, None
        self.prefetch_stream.wait_stream(self.compute)  # the new block may be memory compute just released
        with torch.cuda.stream(self.prefetch_stream):
            target.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.prefetch_stream)
        return target, done

    @staticmethod
    def done(token) -> bool:
        return token is None or token.query()

    def use(self, token) -> bool:
        """Make compute wait for a copy before it reads the copied data (no host wait); whether it was in flight."""
        if token is not None and not token.query():
            self.compute.wait_event(token)
            return True
        return False

    def finish(self, token) -> None:
        """Block the host until a copy is done."""
        if token is not None and not token.query():
            start = time.perf_counter()
            token.synchronize()
            self.wait_s += time.perf_counter() - start
