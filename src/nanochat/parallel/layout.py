"""The process layout: how a run spreads its model over the ranks, decided once, carried as a value.

    DDP x N        every rank holds the whole model; gradients are all-reduced
    FSDP2 x N      parameters, gradients and optimizer state sharded along dim 0 (--fsdp)
    TP N           groups of N consecutive ranks split each layer (--tp N; a group within a node)
    FSDP2 x TP     a 2-D mesh: FSDP2 over the tensor-parallel groups (--fsdp --tp N)

`plan_layout` turns --fsdp and --tp into a `Layout` for the world torchrun started, once, before
the corpus is read (nanochat.train.preflight); a world that cannot form it is refused there, in
one line. Every part that depends on it reads the value instead of the flags: the memory plan
(the shards), the wrapping (nanochat.parallel.wrap), evaluation (a sharded model evaluates on a
gathered copy), the run header, the checkpoints (DCP under torchrun, a .pt in one process).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanochat.common import DistEnv, UsageError
from nanochat.parallel.process_group import backend_name


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A run's process layout (module docstring); `Layout()` is one process. Checked when built:
    a world that cannot form it is a UsageError naming the fix (`layout_problem`)."""

    world_size: int = 1
    rank: int = 0
    tp: int = 1
    """Tensor-parallel degree: groups of `tp` consecutive ranks hold one model replica and read
    the same batches."""
    fsdp: bool = False
    """FSDP2 shards the model over the data-parallel groups: asked (--fsdp), and there are several."""
    backend: str = "none"
    """The process group's: nccl or gloo; none in one process."""
    fallbacks: tuple[str, ...] = ()
    """What was asked and not done, with the reason (the run records them)."""

    def __post_init__(self) -> None:
        if (problem := layout_problem(world_size=self.world_size, tp=self.tp, fsdp=self.fsdp)) is not None:
            raise UsageError(problem)

    @property
    def distributed(self) -> bool:
        """Several processes: collectives run, checkpoints are DCP steps (every rank writes its part)."""
        return self.world_size > 1

    @property
    def dp_size(self) -> int:
        """How many ways each global batch is split: the world size over the tensor-parallel degree."""
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: its share of each global batch."""
        return self.rank // self.tp

    @property
    def sharded(self) -> bool:
        """Parameters are DTensors of which each rank holds a part (FSDP2, TP): evaluation runs on a
        gathered copy (nanochat.parallel.wrap.full_copy), a .pt checkpoint loads through full state dicts."""
        return self.fsdp or self.tp > 1

    @property
    def name(self) -> str:
        """The run header's: 'none', 'ddp x2 (gloo)', 'fsdp x8 (nccl)', 'tp 2 (gloo)', 'fsdp 2 x tp 2 (gloo)'."""
        if not self.distributed:
            return "none"
        if self.tp == 1:
            return f"{'fsdp' if self.fsdp else 'ddp'} x{self.dp_size} ({self.backend})"
        return f"{f'fsdp {self.dp_size} x ' if self.fsdp else ''}tp {self.tp} ({self.backend})"


def layout_problem(*, world_size: int, tp: int, fsdp: bool) -> str | None:
    """Why `world_size` ranks cannot form `--tp tp` groups, else None: the ranks form whole groups,
    and the data-parallel dimension, if any, is FSDP's (DDP does not reduce gradients of DTensor
    shards). Whether a model's layers split by `tp` is the model's (nanochat.model.parallelize)."""
    if tp == 1:
        return None
    if world_size == 1:
        return (f"--tp {tp} splits each layer over {tp} processes, and this is one; launch with torchrun "
                f"--nproc_per_node={tp} (or more, a multiple of {tp}, with --fsdp)")
    if world_size % tp:
        return (f"--tp {tp} on {world_size} ranks: the world size must be a multiple of --tp; launch a multiple of "
                f"{tp} processes")
    if world_size > tp and not fsdp:
        return (f"--tp {tp} on {world_size} ranks leaves {world_size // tp} data-parallel groups, which need --fsdp "
                "(DDP does not reduce gradients of tensor-parallel shards); add --fsdp, or launch "
                f"--nproc_per_node={tp}")
    return None


def plan_layout(env: DistEnv, *, fsdp: bool, tp: int) -> Layout:
    """The Layout of --fsdp and --tp on the ranks `env` names (the process group joined:
    nanochat.parallel.process_group.init_distributed). --fsdp with nothing to shard over is a
    fallback; a world that cannot form --tp, a UsageError."""
    notes = []
    if fsdp and env.world_size == 1:
        notes.append("fsdp: --fsdp ignored in a single process (launch with torchrun --nproc_per_node=N to shard)")
    elif fsdp and env.world_size // tp == 1:
        notes.append(f"fsdp: --fsdp ignored: --tp {tp} on {env.world_size} ranks leaves one data-parallel group, "
                     "nothing to shard over")
    return Layout(world_size=env.world_size, rank=env.rank, tp=tp, fsdp=fsdp and env.world_size // tp > 1,
                  backend=backend_name(), fallbacks=tuple(notes))


__all__ = ["Layout", "layout_problem", "plan_layout"]
