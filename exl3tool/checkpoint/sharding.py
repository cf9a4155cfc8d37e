"""The rank-local weight a vLLM TP rank holds for one layer (docs/layer-plan.md §4), read slice by slice.

The server encodes ``layer.weight`` after its standard weight loaders filled it: q|k|v or the parts of a merged
column layer (gate|up; q|k|v|z of a gated-delta-net ``in_proj_qkvz``; q|k|v|b|f_a of GLM-5.3's KDA
``in_proj_qkvgfab``, whose ``f_a`` part every rank holds whole) sliced per rank and concatenated along the output
dimension in the server's order, row-parallel layers sliced along the input dimension, replicated layers
(``disable_tp`` fused ones too) whole, all cast to the serving dtype. We rebuild exactly that matrix, reading only
the rows/columns the rank needs, so memory stays near one rank-local layer.
"""

from __future__ import annotations

import torch

from exl3tool.checkpoint.plan import RankJob, qkv_partition, rank_sizes
from exl3tool.checkpoint.source import Checkpoint

__all__ = ["rank_local_weight", "encoder_input", "rank_row_ranges", "rank_reads", "RankReads"]

# What a rank reads: ``((source tensor, first row, end row), ...)`` in output order, and the input-column range
# (None: every column). Two jobs with equal reads hold the same rank-local weight, whatever the floats are.
RankReads = tuple[tuple[tuple[str, int, int], ...], "tuple[int, int] | None"]


def rank_row_ranges(job: RankJob) -> list[tuple[int, int, int]]:
    """For row-sliced styles: ``(part, start, stop)`` output rows of each fused part, in fused order.

    Rows are relative to the part's own tensor. Row-parallel and replicated layers take all rows.
    """
    layer, w, r = job.layer, job.tp_size, job.tp_rank
    if layer.parallel == "qkv":
        heads_r, kv_r, _, kr = qkv_partition(layer, w, r)
        hd, vhd = layer.head_dim, layer.v_head_dim
        assert hd is not None and vhd is not None
        return [
            (0, r * heads_r * hd, (r + 1) * heads_r * hd),
            (1, kr * kv_r * hd, (kr + 1) * kv_r * hd),
            (2, kr * kv_r * vhd, (kr + 1) * kv_r * vhd),
        ]
    if layer.parallel == "merged_column":
        return [(j, 0, n) if j in layer.replicated_parts else (j, r * n // w, (r + 1) * n // w)
                for j, n in enumerate(layer.part_sizes)]
    if layer.parallel == "column":
        n = layer.out_features
        return [(0, r * n // w, (r + 1) * n // w)]
    return [(j, 0, n) for j, n in enumerate(layer.part_sizes)]


def rank_reads(job: RankJob) -> RankReads:
    """The slices of the checkpoint that make up ``job``'s rank-local weight: the sharding plan, no tensor read.

    Row ranges that continue each other in the same source tensor are merged (reading them as one range gives the
    same matrix), so the reads are a canonical description of the weight: a replicated layer reads the same on
    every rank and TP size, and so does any other shard the plan makes equal. The encode's other inputs (bits,
    serving dtype, the prefix's seed) are the same for every job of a warm with the same prefix.
    """
    layer = job.layer
    cols = None
    if layer.parallel == "row":
        w, r, k = job.tp_size, job.tp_rank, layer.in_features
        cols = None if w == 1 else (r * k // w, (r + 1) * k // w)  # every column: the same read as no slice
    pieces: list[tuple[str, int, int]] = []
    for part, start, stop in rank_row_ranges(job):
        source, base = layer.part_location(part)  # which tensor holds the part, and where it starts in it
        name, lo, hi = layer.sources[source], base + start, base + stop
        if hi == lo:
            continue
        if pieces and pieces[-1][0] == name and pieces[-1][2] == lo:
            pieces[-1] = (name, pieces[-1][1], hi)
        else:
            pieces.append((name, lo, hi))
    return tuple(pieces), cols


def rank_local_weight(checkpoint: Checkpoint, job: RankJob, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The ``[N_r, K_r]`` weight rank ``job.tp_rank`` holds, in ``dtype`` (default: the checkpoint's serving dtype).

    Example: for ``model.layers.0.self_attn.qkv_proj`` at TP 2 rank 1 this is
    ``cat([q[hq:2hq], k[kv-slice], v[kv-slice]])`` with ``hq = heads/2 * head_dim``.
    """
    layer = job.layer
    dtype = dtype or checkpoint.dtype
    k_r, n_r = rank_sizes(layer, job.tp_size)
    if (k_r, n_r) != (job.input_size, job.output_size):
        raise ValueError(f"{layer.prefix}: job sizes K_r={job.input_size}, N_r={job.output_size} do not match the "
                         f"layer at TP {job.tp_size} (K_r={k_r}, N_r={n_r})")
    if not 0 <= job.tp_rank < job.tp_size:
        raise ValueError(f"{layer.prefix}: tp_rank {job.tp_rank} outside 0..{job.tp_size - 1}")

    pieces, cols = rank_reads(job)
    weight_pieces = [checkpoint.read(name, rows=(start, stop), cols=cols).to(dtype) for name, start, stop in pieces]
    weight = weight_pieces[0] if len(weight_pieces) == 1 else torch.cat(weight_pieces, dim=0)
    weight = weight.contiguous()
    if tuple(weight.shape) != (n_r, k_r):
        raise ValueError(f"{layer.prefix}: rank {job.tp_rank} weight has shape {list(weight.shape)}, "
                         f"expected [{n_r}, {k_r}]")
    return weight


def encoder_input(weight: torch.Tensor) -> torch.Tensor:
    """What the encoder consumes: the rank-local weight transposed to ``[K_r, N_r]``, float32, contiguous (docs/cache-format.md §7)."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D [N_r, K_r] weight, got shape {list(weight.shape)}")
    return weight.t().to(torch.float32).contiguous()
