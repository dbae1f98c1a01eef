"""This machine's rate curve, fitted in seconds on a few small steps and kept beside its measured profile.

A profile measured here (NOTE [the profile for this machine]) gives copy bandwidths and the best matmul and
convolution rates; what an op of a given size achieves is far from the best (a small convolution, a
layer norm), so simulating from the profile's figures alone comes out 15-35% fast on a CPU. Three small
steps (a convolutional net, an MLP of several widths, a transformer layer), profiled op by op, span the op
kinds and sizes that matter (1e5 to 1e10 FLOPs) and give the curve the simulator interpolates in.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from udnn_lab.cost.model import RateCurve
from udnn_lab.cost.profiling import profile
from udnn_lab.devices import device_name
from udnn_lab.hardware import Hardware, MachineDevice, cache_dir


def machine_rates(hardware: Hardware, progress: bool = True) -> RateCurve | None:
    """The rate curve for ``hardware`` where it is this machine's measured profile: cached, else fitted now.

    None for a profile of another device (a shipped one, or one measured elsewhere): its figures are all there is.
    """
    device = MachineDevice.of(hardware.device_type)
    if not (hardware.measured and device.here and device.name in hardware.device_names):
        return None
    path = cache_dir() / "rates" / f"{device.cache_key}.json"
    if path.is_file():
        try:
            return RateCurve.load(path)
        except (ValueError, OSError):
            pass  # cut short or from another version: fitted again
    curve = calibrate(hardware.device_type, progress)
    _save(curve, path)
    return curve


def calibrate(device_type: str, progress: bool = True, repeats: int = 3) -> RateCurve:
    """Profile the calibration steps on this machine's ``device_type`` and fit their rate curve."""
    device = torch.device(device_type)
    steps = _calibration_steps()
    profiles = []
    with _seeded(), tqdm(steps, desc=f"timing ops on {device_name(device)}", disable=not progress,
                          leave=False) as bar:
        for name, build in bar:
            model, example, target = (part.to(device) for part in build())
            optimizer = torch.optim.AdamW(model.parameters())
            profiles.append(profile(model, example, nn.functional.cross_entropy, optimizer, target=target,
                                    repeats=repeats, name=name))
    return RateCurve.fit(profiles, source=f"fitted on {', '.join(name for name, _ in steps)} on "
                         f"{device_name(device)}, {torch.get_num_threads()} threads, torch {torch.__version__}")


Builder = Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]]  # built on the CPU, moved where timed


def _calibration_steps() -> list[tuple[str, Builder]]:
    return [("a convolutional net", _convolutions), ("an MLP", _mlp), ("a transformer layer", _transformer)]


def _convolutions() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    layers: list[nn.Module] = []
    for inputs, outputs in ((3, 32), (32, 64), (64, 128), (128, 256)):
        layers += [nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(),
                   nn.MaxPool2d(2)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))
    return model, torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    widths = (256, 1024, 2048, 512)
    layers: list[nn.Module] = []
    for inputs, outputs in zip(widths, widths[1:]):
        layers += [nn.Linear(inputs, outputs), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(widths[-1], 10))
    return model, torch.randn(1024, widths[0]), torch.randint(0, 10, (1024,))


class _Transformer(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(dim=1))


def _transformer() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return _Transformer(), torch.randn(8, 128, 256), torch.randint(0, 10, (8,))


@contextmanager
def _seeded() -> Iterator[None]:
    """Random weights from a fixed seed, and torch's global RNG as it was afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def _save(curve: RateCurve, path: Path) -> None:
    """Atomically (several processes may calibrate at once); a cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            json.dump(curve.to_dict(), handle, indent=1)
        os.replace(handle.name, path)
    except OSError:
        pass
