"""The records a Graph is made of: its tensors (storages), ops, module calls and hook events.

Plain frozen data, in a module of their own so that what reads a Graph's records (liveness) and the Graph
itself (step_graph) import them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from udnn_lab.units import cuda_block_bytes
from udnn_lab.vocabulary import Category, Phase


@dataclass(frozen=True)
class TensorInfo:
    """One storage and its life during the step."""

    id: int
    name: str  # parameter/buffer name, 'input', 'grad:<param>', '<param>.<state>', else 't<k>'
    nbytes: int  # exact bytes of the storage
    dtype: str
    shape: tuple[int, ...]  # shape of the first tensor seen on this storage
    device: str  # 'cpu' or 'cuda'; 'cpu' in a CUDA graph: host memory (an offloaded parameter shard, ...)
    category: Category
    producer: int | None  # op that allocated it; None if it existed before the step
    consumers: tuple[int, ...]  # ops that read it, in execution order
    saved: bool  # autograd saved it (or a view of it) for backward
    saved_by: tuple[int, ...]  # forward ops whose autograd node saved it
    alloc_step: int  # first step at which it is live; -1 before the step
    free_step: int | None  # released right after this op; None if alive at the end
    module: str  # module path of the producer op ('' is the model itself)
    last_forward_use: int | None = None  # last forward op that produced or read it
    first_backward_use: int | None = None  # first backward op that read it
    # what holds it besides autograd (NOTE [forward holders] in analysis/_holders.py): forward lets it go right
    # after this op (None: not known, as after its last forward use); the caller still holds it after forward
    forward_release: int | None = None
    held_past_forward: bool = False

    @property
    def cuda_nbytes(self) -> int:
        """Bytes the CUDA caching allocator would reserve for it (512-byte blocks)."""
        return cuda_block_bytes(self.nbytes)

    @property
    def first_use(self) -> int | None:
        if self.producer is not None:
            return self.producer
        return self.consumers[0] if self.consumers else None

    @property
    def last_use(self) -> int | None:
        """Last op that produced or read it: its true last use, whatever held it afterwards."""
        uses = list(self.consumers)
        if self.producer is not None:
            uses.append(self.producer)
        return max(uses) if uses else None


@dataclass(frozen=True)
class OpInfo:
    """One aten op of the step."""

    index: int
    phase: Phase
    module: str  # innermost module path; backward ops get their forward op's module
    name: str  # e.g. 'aten.convolution.default'
    inputs: tuple[int, ...]  # tensor ids read
    outputs: tuple[int, ...]  # tensor ids returned (new or aliased)
    allocated: tuple[int, ...]  # tensor ids whose storage this op created
    released: tuple[int, ...]  # tensor ids released right after this op
    forward_op: int | None  # forward op whose autograd node ran this backward op
    output_shapes: tuple[tuple[int, ...], ...] = ()
    flops: int = 0  # by torch.utils.flop_counter's formulas; 0 for ops it does not count
    bytes_read: int = 0  # bytes of the input tensors as the op sees them; 0 for views
    bytes_written: int = 0  # bytes of its outputs; 0 for views
    # ranks taking part in this collective (the size of its process group: the world, or an HSDP replicate or
    # shard group); 1 for every other op, and for collectives of graphs traced before it was recorded
    ranks: int = 1
    rank_stride: int = 1  # distance between the group's consecutive global ranks (HSDP's replicate group: > 1)


@dataclass(frozen=True)
class HookEvent:
    """One call of a hook a runtime can follow without a dispatch mode, in the order they came (NOTE [hook points]).

    'enter' and 'exit': a module's forward starts or returns; 'pack': autograd saves a tensor
    for backward (an op's inputs before it runs, its outputs after); 'unpack': a backward node
    starts and takes a saved tensor back. Each comes after op ``boundary - 1`` and before op
    ``boundary``. The module class of enter and exit, and a pack's node, dtype and shape, are
    the step's fingerprint, with each module's mode (train or eval).
    """

    kind: Literal["enter", "exit", "pack", "unpack"]
    boundary: int
    tensor: int = -1  # pack, unpack: Graph tensor id of the storage (-1: one the trace does not track)
    node: str = ""  # enter, exit: the module's class; pack: the saved tensor's autograd node ('' for leaves)
    dtype: str = ""  # pack: str(torch dtype), e.g. 'torch.float32'
    shape: tuple[int, ...] = ()  # pack: the saved view's shape
    packed_at: int = -1  # unpack: the position in the step's hook events of the pack it takes back
    # enter, exit: no saved-tensor hooks pushed inside the step were in force (NOTE [hook points] 5)
    own_hooks: bool = True
    training: bool = True  # enter, exit: the module's mode
    # exit: the call's arguments were tensors and plain values only (no object its forward could change, like a
    # cache): calling it again changes nothing outside it (NOTE [hook points] 7)
    plain_arguments: bool = True
    # enter, exit: the module's path in the traced model ('' the model itself; None: a module outside it, or a step
    # traced before paths were recorded): where a runtime hooks that module alone (NOTE [hook points] 8)
    path: str | None = None


@dataclass(frozen=True)
class ModuleCall:
    """One call of a module's forward."""

    path: str  # '' is the model itself
    type: str  # class name
    first_op: int  # first op index inside the call (== last_op + 1 if it ran none)
    last_op: int
    outputs: tuple[int, ...]  # tensor ids of the call's returned tensors
