"""Tensor parallelism for the project's decoders over ``torch.distributed`` process groups.

Megatron-style sharding of each decoder layer across the ``size`` ranks of a process group:

- ``qkv_proj`` (column parallel): rank ``r`` keeps the rows of its query heads and of its
  KV heads (the fused ``[q | k | v]`` weight is sliced per part, not in contiguous chunks);
- the ``Attention`` layer of a rank owns only those heads, so ``bind_kv_caches`` gives each
  rank its KV-cache shard ``[num_blocks, 2, block_size, local_kv_heads * head_size]``;
- ``o_proj`` (row parallel): the input columns of its query heads; the partial outputs are
  summed over the group (one all-reduce);
- ``gate_up_proj`` (column parallel: its slice of the gate rows and of the up rows) and
  ``down_proj`` (row parallel, all-reduce);
- embedding, norms, rotary tables and ``lm_head``: replicated, so every rank computes the
  full logits (vocab-parallel embedding / lm_head would save memory on big vocabularies at
  the cost of an all-gather; not needed for these models).

Query heads are split evenly (``num_heads % size == 0``). KV heads are split evenly when
``num_kv_heads % size == 0``; when there are fewer KV heads than ranks
(``size % num_kv_heads == 0``) each KV head is replicated on ``size // num_kv_heads``
ranks, the ones whose query heads read it (as vLLM does). Anything else is rejected.

The all-reduce is PyTorch's functional collective (``_c10d_functional.all_reduce`` +
``wait_tensor``, the ops DTensor also lowers to): eager calls run it on the group's backend
(gloo, NCCL, RCCL), and Dynamo / Inductor trace it as two graph nodes between layers, never
inside a RoPE / QK-norm / cache-write site, so the plugin's fusions and piecewise graph
capture see each rank's graph as they see a single-GPU one.

Example (one process per rank, e.g. under ``torchrun``)::

    dist.init_process_group("nccl")
    tp = TensorParallel.from_group()                     # the default group
    model = TinyDecoder(cfg, tp=tp).to("cuda", torch.bfloat16)
    model.load_state_dict(shard_state_dict(full_state_dict, cfg, tp))
    ira.bind_kv_caches(model, num_blocks, torch.bfloat16, "cuda")   # this rank's shard
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .validation import is_int

if TYPE_CHECKING:
    from .models import DecoderConfig, TinyDecoder

__all__ = ["TensorParallel", "HeadShard", "RowParallelLinear", "shard_heads", "shard_state_dict",
           "shard_model", "all_reduce", "check_tensor_parallel"]


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum ``x`` over the group named ``group_name`` (functional: returns a new tensor)."""
    return torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(x, "sum", group_name))


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """The heads of one layer that one rank owns: query heads
    ``[q_start, q_start + num_heads)`` and KV heads ``[kv_start, kv_start + num_kv_heads)``;
    ``kv_replicas`` ranks hold each of those KV heads (1 when KV heads are split)."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int
    kv_replicas: int


def _check_rank(size, rank) -> None:
    """A size of >= 1 ranks and a rank in [0, size), both ints (float ones gave float head
    counts and starts)."""
    if not is_int(size) or not is_int(rank) or size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor parallel: rank {rank!r} of size {size!r} is not a valid rank; supported: "
                         "int size >= 1 and int rank in [0, size)")


def shard_heads(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """Rank ``rank`` of ``size``'s heads; raises ``ValueError`` for a split it cannot make."""
    _check_rank(size, rank)
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not is_int(value) or value < 1:
            raise ValueError(f"tensor parallel: {name} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"tensor parallel: num_heads={num_heads} is not a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if num_heads % size:
        raise ValueError(f"tensor parallel: num_heads={num_heads} cannot be split over {size} "
                         "ranks; supported: num_heads a multiple of the tensor-parallel size")
    local_q = num_heads // size
    if num_kv_heads % size == 0:
        local_kv, replicas = num_kv_heads // size, 1
        kv_start = rank * local_kv
    elif size % num_kv_heads == 0:  # fewer KV heads than ranks: replicate each one
        local_kv, replicas = 1, size // num_kv_heads
        kv_start = rank // replicas
    else:
        raise ValueError(
            f"tensor parallel: num_kv_heads={num_kv_heads} over {size} ranks: KV heads are "
            "split when num_kv_heads is a multiple of the tensor-parallel size and replicated "
            "when the size is a multiple of num_kv_heads; neither holds")
    return HeadShard(local_q, local_kv, rank * local_q, kv_start, replicas)


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` over this rank's slice of the input features; the partial outputs are
    summed over the group, so every rank gets the full ``[T, out_features]`` result.
    No bias (a bias would have to be added once, after the sum)."""

    def __init__(self, in_features: int, out_features: int, group_name: str,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.group_name = group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight), self.group_name)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, all_reduce over group {self.group_name!r}"


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """One rank's place in a tensor-parallel group: what the model layers need to shard."""

    size: int
    rank: int
    group_name: str

    def __post_init__(self):
        _check_rank(self.size, self.rank)
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ValueError(f"tensor parallel: group_name must be a process group's name (a non-empty str), "
                             f"got {self.group_name!r}")

    @classmethod
    def from_group(cls, group: Any = None) -> "TensorParallel":
        """From a ``ProcessGroup``, a 1-D ``DeviceMesh``, or ``None`` (the default group)."""
        import torch.distributed as dist

        if group is not None and not hasattr(group, "get_group") and not isinstance(group, dist.ProcessGroup):
            # an int or a backend name is not a group: refused by name, not as a late AttributeError
            raise TypeError(f"TensorParallel.from_group: group must be a ProcessGroup, a 1-D DeviceMesh or None (the "
                            f"default group), got {type(group).__name__} {group!r:.60}")
        if not dist.is_initialized():
            raise RuntimeError("tensor parallel: call torch.distributed.init_process_group first")
        if hasattr(group, "get_group"):  # DeviceMesh
            group = group.get_group()
        if group is None:
            group = dist.group.WORLD
        return cls(dist.get_world_size(group), dist.get_rank(group), group.group_name)

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        return shard_heads(num_heads, num_kv_heads, self.size, self.rank)

    def intermediate(self, intermediate_size: int) -> int:
        """This rank's slice of the MLP's intermediate size."""
        if intermediate_size % self.size:
            raise ValueError(f"tensor parallel: intermediate_size={intermediate_size} cannot be "
                             f"split over {self.size} ranks; it must be a multiple of the size")
        return intermediate_size // self.size

    def row_linear(self, in_features: int, out_features: int) -> RowParallelLinear:
        return RowParallelLinear(in_features, out_features, self.group_name)


def check_tensor_parallel(who: str, tp, *, optional: bool = False) -> None:
    """``tp``: a ``TensorParallel`` (``optional``: or None); anything else failed as an
    AttributeError deep in the sharding."""
    if not isinstance(tp, TensorParallel) and not (optional and tp is None):
        raise TypeError(f"{who}: tp must be a TensorParallel (TensorParallel.from_group(...) or TensorParallel(size, "
                        f"rank, group_name)){' or None' if optional else ''}, got {tp!r:.60}")


def _slices(cfg: "DecoderConfig", tp: TensorParallel) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """Per decoder-layer weight: (dim, [(start, stop), ...]) of the full weight this rank keeps."""
    d, hq, hkv = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
    h = tp.heads(hq, hkv)
    inter = tp.intermediate(cfg.intermediate_size)
    i0 = tp.rank * inter
    q = (h.q_start * d, (h.q_start + h.num_heads) * d)
    kv = (h.kv_start * d, (h.kv_start + h.num_kv_heads) * d)
    return {
        "qkv_proj.weight": (0, [q, (hq * d + kv[0], hq * d + kv[1]),
                                (hq * d + hkv * d + kv[0], hq * d + hkv * d + kv[1])]),
        "o_proj.weight": (1, [q]),
        "gate_up_proj.weight": (0, [(i0, i0 + inter), (cfg.intermediate_size + i0,
                                                        cfg.intermediate_size + i0 + inter)]),
        "down_proj.weight": (1, [(i0, i0 + inter)]),
    }


def _full_shapes(cfg: "DecoderConfig") -> dict[str, tuple[int, ...]]:
    """Per decoder-layer weight that carries the head geometry: its shape in the full model."""
    d, hq, hkv, hidden, inter = cfg.head_size, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkv_proj.weight": ((hq + 2 * hkv) * d, hidden), "o_proj.weight": (hidden, hq * d),
              "gate_up_proj.weight": (2 * inter, hidden), "down_proj.weight": (hidden, inter)}
    if cfg.qk_norm:
        shapes.update({"q_norm.weight": (d,), "k_norm.weight": (d,)})
    return shapes


def shard_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: "DecoderConfig",
                     tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's shard of a full ``TinyDecoder`` state dict (to load into
    ``TinyDecoder(cfg, tp=tp)``). Sharded weights are copies (contiguous); replicated
    tensors are passed through.

    Every weight that carries the head geometry must have its full shape under ``cfg``: a
    state dict of another model whose fused qkv is as wide (8 + 2 * 2 query/KV heads against
    4 + 2 * 4) differs in ``o_proj``, and is refused. Two models whose every weight has the
    same shape (Llama-style, no QK-norm: 8 + 2 * 2 heads of 64 against 4 + 2 * 1 of 128) hold
    nothing that tells them apart; the head split follows ``cfg``."""
    check_tensor_parallel("shard_state_dict", tp)
    slices = _slices(cfg, tp)
    shapes = _full_shapes(cfg)
    for key, value in state_dict.items():  # all checked before any weight is cut
        want = next((shape for suffix, shape in shapes.items() if key.endswith("." + suffix)), None)
        if want is not None and tuple(value.shape) != want:
            raise ValueError(
                f"shard_state_dict: {key} has shape {tuple(value.shape)} but the model of cfg (num_heads="
                f"{cfg.num_heads}, num_kv_heads={cfg.num_kv_heads}, head_size={cfg.head_size}, hidden_size="
                f"{cfg.hidden_size}, intermediate_size={cfg.intermediate_size}) has {want}: the state dict is not "
                "of this config's model")
    out = {}
    for key, value in state_dict.items():
        rule = next((r for suffix, r in slices.items() if key.endswith("." + suffix)), None)
        if rule is None:
            out[key] = value
            continue
        dim, spans = rule
        out[key] = torch.cat([value.narrow(dim, a, b - a) for a, b in spans], dim=dim).contiguous()
    return out


def shard_model(model: "TinyDecoder", tp: TensorParallel, name: str | None = None) -> "TinyDecoder":
    """A new ``TinyDecoder`` holding this rank's shard of ``model`` (same device, dtype and
    train/eval mode). Its attention layers are named after ``name`` (default: a fresh model
    name), so the full model can stay alive beside it; bind its KV caches with
    ``bind_kv_caches`` afterwards."""
    from .models import TinyDecoder

    check_tensor_parallel("shard_model", tp)
    group = next((m.group_name for m in model.modules() if isinstance(m, RowParallelLinear)), None)
    if group is not None:  # its weights are cut already: refused as "not of this config's model"
        raise ValueError(f"shard_model: the model is already a tensor-parallel shard (its row-parallel linears "
                         f"all-reduce over group {group!r}); shard the full model")
    p = next(model.parameters())
    shard = TinyDecoder(model.cfg, name=name, tp=tp).to(device=p.device, dtype=p.dtype)
    shard.load_state_dict(shard_state_dict(model.state_dict(), model.cfg, tp))
    return shard.train(model.training)
