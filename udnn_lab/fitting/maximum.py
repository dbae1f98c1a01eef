"""max_batch() and max_seq_len(): the largest batch size, or sequence length, whose training step fits a budget.

Each size is traced on the meta device under fake tensors (no weights allocated, no GPU needed) and held
against the budget: its traced peak under keep-all, a feasible ``plan()`` under another policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from udnn_lab import zoo
from udnn_lab.fitting.probing import StepFactory, StepProber
from udnn_lab.fitting.result import FitSearch, Probe, disagreements
from udnn_lab.fitting.search import Bracket, largest_fitting
from udnn_lab.hardware import PREDICTED_DEVICE, Hardware
from udnn_lab.planning import POLICIES, check_within_device, host
from udnn_lab.planning.reserved import check_count_name
from udnn_lab.simulation.simulator import resolve_hardware
from udnn_lab.units import format_bytes, parse_bytes
from udnn_lab.vocabulary import Dimension
from udnn_lab.workload import Workload

PROGRESS_SECONDS = 3.0  # by default a search shows its progress bar once it has run this long (as measure() does)


def max_batch(model: str | Callable[[int], Workload], budget: int | str | None = None, *, policy: str = "keep-all",
              hardware: Hardware | str | None = None, start: int = 1, limit: int | None = None, multiple_of: int = 1,
              host_budget: int | str | None = "local", progress: bool | None = None, counts: str = "allocated",
              outside_bytes: int | str = 0, **options: Any) -> FitSearch:
    """The largest batch size whose training step fits ``budget`` (default: all of ``hardware``'s memory).

    ``model``: a zoo name, with ``options`` passed to ``ul.zoo.get`` (``seq_len=4096``,
    ``dtype=torch.bfloat16``, ``optimizer="adamw"``, ...), or a callable ``batch -> Workload``
    for your own model (build it on the meta device: only shapes are used). Fitting means the
    traced peak is within the budget under ``policy="keep-all"``, and that ``ul.plan`` finds a plan
    under any other policy. ``hardware`` decides the device whose memory is counted (CUDA:
    512-byte blocks; default None: the profile for this machine's GPU, as the CLI and MemoryLab use); a
    budget above its memory raises BudgetOverDevice. Sizes double from ``start`` until one does not fit, then the gap is
    bisected, trying only multiples of ``multiple_of``, never above ``limit``. ``host_budget``:
    the host memory a plan's offloads may take (the runtime's pinned pool); by default ("local")
    the share the runtime would take on this machine, half of what is available now (NOTE [host
    budget] in planning/host.py); give the training machine's figure when it is another, or None
    not to check. ``counts='reserved'`` (a CUDA profile): a size fits when the caching allocator model's
    reserved peak for its step (or its plan's), plus ``outside_bytes`` (the CUDA context, libraries' workspaces),
    is within the budget: the number an out-of-memory error is about (planning/reserved.py). Before each size
    is built, the host memory building it takes (what the sizes
    before it took, extrapolated) is held against what this machine has: HostMemoryTooSmall says
    so rather than the machine running out. ``progress``: show a progress bar (default: once the
    search has run a few seconds).
    """
    if "batch" in options:
        raise TypeError("max_batch searches the batch size: leave batch out of its options")
    build = _factory(model, options, lambda name, size: zoo.get(name, batch=size, **_on_meta(options)))
    return _search(build, _label(model), "batch", _Setting(budget, policy, hardware, host_budget, counts,
                                                           parse_bytes(outside_bytes)),
                   _Sizes(start, limit, multiple_of, "the limit given"), progress)


def max_seq_len(model: str | Callable[[int], Workload], budget: int | str | None = None, *, batch: int = 1,
                policy: str = "keep-all", hardware: Hardware | str | None = None, start: int = 1,
                limit: int | None = None, multiple_of: int = 1, host_budget: int | str | None = "local",
                progress: bool | None = None, counts: str = "allocated", outside_bytes: int | str = 0,
                **options: Any) -> FitSearch:
    """The longest sequence whose training step at ``batch`` fits ``budget``; as ``max_batch``, for 'hf:' text models.

    The search stops at the model's positions (its ``max_position_embeddings``) when every
    length up to them fits. ``model`` may also be a callable ``seq_len -> Workload`` (that
    builds its batch itself: ``batch`` and ``options`` are for zoo names).
    """
    if "seq_len" in options:
        raise TypeError("max_seq_len searches the sequence length: leave seq_len out of its options")
    if not isinstance(model, str) and batch != 1:
        raise TypeError("batch is for a zoo name: a callable seq_len -> Workload builds its batch itself")
    why = "the limit given"
    if isinstance(model, str):
        positions = _text_model_positions(model, options)
        if positions is not None and (limit is None or positions < limit):
            limit, why = positions, f"the {positions} positions {model} has"
    build = _factory(model, options, lambda name, size: zoo.get(name, batch=batch, seq_len=size, **_on_meta(options)))
    return _search(build, _label(model), "seq_len", _Setting(budget, policy, hardware, host_budget, counts,
                                                             parse_bytes(outside_bytes)),
                   _Sizes(start, limit, multiple_of, why), progress)


@dataclass(frozen=True)
class _Setting:
    """What a size must fit: the budget, under which policy, on which hardware, within which host budget."""

    budget: int | str | None
    policy: str
    hardware: Hardware | str | None
    host_budget: int | str | None
    counts: str = "allocated"  # or 'reserved', with outside_bytes (planning/reserved.py)
    outside_bytes: int = 0


@dataclass(frozen=True)
class _Sizes:
    """The sizes a search may try: from ``start``, multiples of ``multiple_of``, up to ``limit`` (``limit_reason``
    says where that came from)."""

    start: int
    limit: int | None
    multiple_of: int
    limit_reason: str


def _search(build: StepFactory, label: str, dimension: Dimension, setting: _Setting, sizes: _Sizes,
            progress: bool | None) -> FitSearch:
    budget, policy, hardware, host_budget = setting.budget, setting.policy, setting.hardware, setting.host_budget
    start, limit, multiple_of, limit_reason = sizes.start, sizes.limit, sizes.multiple_of, sizes.limit_reason
    profile = resolve_hardware(hardware, PREDICTED_DEVICE)
    budget_bytes = _budget(budget, profile)
    host_budget_bytes, host_note = _host_budget(host_budget, policy, profile.device_type, budget_bytes)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; the policies are: {', '.join(POLICIES)}")
    _check_sizes(start, limit, multiple_of)
    counted = _counted(setting, profile)
    prober = StepProber(build, budget_bytes, policy, profile, dimension, host_budget_bytes, setting.counts,
                        setting.outside_bytes)
    name = "sequence length" if dimension == "seq_len" else "batch"
    bar = tqdm(desc=f"largest {name} of {label} in {format_bytes(budget_bytes)}", unit="probe", leave=False,
               disable=progress is False, delay=0 if progress else PROGRESS_SECONDS)

    def probe(size: int) -> Probe:
        found = prober(size)
        bar.update(1)
        bar.set_postfix_str(f"{name} {size}: {format_bytes(found.peak_bytes)}, {'fits' if found.fits else 'too big'}")
        return found

    with bar:
        bracket = largest_fitting(probe, start, limit, multiple_of)
    notes = prober.notes + disagreements(bracket.probes) + host_note + counted
    return FitSearch(
        model_name=prober.model_name or label, dimension=dimension, size=bracket.fitting.size if bracket.fitting else 0,
        peak_bytes=bracket.fitting.peak_bytes if bracket.fitting else None,
        failed_size=bracket.failed.size if bracket.failed else None,
        failed_peak_bytes=bracket.failed.peak_bytes if bracket.failed else None,
        stopped=_why_stopped(bracket, name, limit_reason, prober.weights_bytes, budget_bytes), probes=bracket.probes,
        budget_bytes=budget_bytes, policy=policy, hardware=profile.name, device=profile.device_type,
        weights_bytes=prober.weights_bytes, host_budget_bytes=host_budget_bytes, multiple_of=multiple_of, limit=limit,
        notes=notes)


def _counted(setting: _Setting, profile: Hardware) -> tuple[str, ...]:
    """Check what the budget counts; the note that says so where it is not allocated bytes."""
    check_count_name(setting.counts)
    if setting.counts == "allocated":
        return ()
    if profile.device_type != "cuda":
        raise ValueError(f"counts='reserved' needs a CUDA profile ({profile.name} is {profile.device_type}'s, where no "
                         "caching allocator reserves memory): pass hardware= a GPU's profile, or count allocated bytes")
    return (f"peaks counted as reserved bytes: the caching allocator model's reserved peak plus "
            f"{format_bytes(setting.outside_bytes)} outside the allocator",)


def _why_stopped(bracket: Bracket, name: str, limit_reason: str, weights: int, budget_bytes: int) -> str:
    if bracket.failed is None:
        assert bracket.fitting is not None
        return f"{name} {bracket.fitting.size} fits and is the largest to try ({limit_reason})"
    failed, needs = f"{name} {bracket.failed.size}", f"needs {format_bytes(bracket.failed.peak_bytes)}"
    if bracket.failed.peak_bytes <= budget_bytes:  # the device fits it: the host memory for its offloads does not
        needs = f"fits the device but its offloads need {format_bytes(bracket.failed.host_bytes)} of host memory"
    if bracket.fitting is None:
        return f"not even {failed} fits: it {needs}, the weights alone {format_bytes(weights)}"
    return f"{failed} {needs}"


def _factory(model: str | Callable[[int], Workload], options: dict[str, Any],
             from_zoo: Callable[[str, int], Workload]) -> StepFactory:
    if isinstance(model, str):
        _check_name(model)
        return lambda size: from_zoo(model, size)
    if not callable(model):
        raise TypeError(f"model must be a zoo name or a callable size -> Workload, got {type(model).__name__}")
    if options:
        raise TypeError(f"{', '.join(sorted(options))}: options are for a zoo name; a callable builds the step itself")
    return model


def _on_meta(options: dict[str, Any]) -> dict[str, Any]:
    """Zoo options with the model built on the meta device (only shapes are traced), unless they name a device."""
    return {"device": "meta", **options}


def _check_name(name: str) -> None:
    """Raise UnknownModelError for a name the zoo does not know, before any step is built."""
    if name.lower().startswith(zoo.hf_configs.PREFIX):
        zoo.hf_configs.spec(name)
    elif ":" not in name:  # 'package.module:factory' is loaded when the step is built
        zoo.entry(name)


def _text_model_positions(name: str, options: dict[str, Any]) -> int | None:
    """The positions of an 'hf:' text model (ValueError for another model: its input has no sequence length)."""
    if not name.lower().startswith(zoo.hf_configs.PREFIX):
        _check_name(name)
        raise ValueError(f"max_seq_len searches the sequence length of 'hf:' text models, and {name} is not one: "
                         "for your own model give ul.max_seq_len a callable seq_len -> Workload")
    if zoo.hf_configs.spec(name).task == "image-classification":
        raise ValueError(f"{name} takes images, not tokens: it has no sequence length to search; use max_batch")
    return zoo.hf.max_positions(name, small=options.get("small", False),
                                config_overrides=options.get("config_overrides"))


def _budget(budget: int | str | None, hardware: Hardware) -> int:
    if budget is None:
        return int(hardware.memory_bytes)
    try:
        budget_bytes = parse_bytes(budget)
    except (TypeError, ValueError) as error:
        raise ValueError(f"cannot read the budget {budget!r}: {error}; give bytes or a size such as '80GiB'") from None
    if budget_bytes <= 0:
        raise ValueError(f"the budget must be more than 0 bytes, got {budget!r}")
    check_within_device(budget_bytes, hardware)  # a search past the device's memory would try sizes it cannot hold
    return budget_bytes


def _host_budget(host_budget: int | str | None, policy: str, device: str,
                 budget_bytes: int) -> tuple[int | None, tuple[str, ...]]:
    """The host bytes offloads may take (NOTE [host budget] in planning/host.py), and a note saying where the
    figure comes from."""
    if host_budget is None or policy == "keep-all":
        return None, ()
    held = host.host_budget_bytes(host_budget, device, budget_bytes)
    assert held is not None  # None was answered above
    return held, (host.local_note(held, device),) if host.is_local(host_budget) else ()


def _check_sizes(start: int, limit: int | None, multiple_of: int) -> None:
    for label, value in (("start", start), ("multiple_of", multiple_of), ("limit", limit)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    first = -(-start // multiple_of) * multiple_of  # the first multiple of multiple_of at or above start
    if limit is not None and limit < first:
        raise ValueError(f"the limit {limit} is below the first size to try, {first}: raise the limit or lower start")


def _label(model: str | Callable[[int], Workload]) -> str:
    return model if isinstance(model, str) else getattr(model, "__name__", type(model).__name__)
