"""A cluster, a layout of a training job on it, the estimate of a step, and the efficiency model.

`Cluster` names the GPUs (a preset of GPUS, from the vendors' published specifications, or the
numbers given), `Layout` the job's split (tensor, pipeline and data parallelism, microbatch,
interleaving, sequence parallelism, recomputation, FSDP), `Estimate` what `autoshard.estimate`
predicts of a step (planner.step works it out from autoshard's own plan of the model).

The efficiency model (one for every GPU and model, nothing fitted per published run):
- a matmul of shape (batch, m, n, k) takes the roofline's time at a fraction of the peak:
  max(2 batch m n k / (peak x gemm), bytes moved / (hbm x HBM_EFFICIENCY)) + LAUNCH, where
  bytes moved = 2 batch (mk + kn + mn) (16-bit operands) and `gemm` the GPU's large-GEMM fraction
  of peak (cuBLAS on large bf16/fp16 shapes, public measurements: GPUS);
- an element-wise op (norms, softmax, dropout, activations, casts) moves its inputs and output
  through HBM at HBM_EFFICIENCY of the bandwidth, + LAUNCH;
- a ring collective of n bytes over g ranks sends `ring_bytes` (2(g-1)/g n for an all-reduce) at
  COMM_EFFICIENCY of the link's bandwidth per GPU (NVLink inside a node; between nodes the network's
  a GPU times the group's ranks a node, `links`) scaled by the message's size, m / (m + COMM_HALF):
  small messages reach less (NCCL's bus bandwidth curve), plus a latency a ring step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..runtime.counters import ring_bytes, split_kind

GiB = 2 ** 30

# name -> (dense bf16/fp16 peak flop/s, memory bytes, HBM bytes/s, NVLink bytes/s a GPU one way,
#          network bytes/s a GPU one way, large-GEMM fraction of peak). Sources (docs/design.md):
# NVIDIA A100 Tensor Core GPU datasheet (312 TFLOPS bf16 dense; 40 GB HBM2 1,555 GB/s, 80 GB HBM2e
# 2,039 GB/s; NVLink 600 GB/s bidirectional), NVIDIA H100 datasheet (SXM: 989 TFLOPS bf16 dense,
# 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s bidirectional), NVIDIA H200 datasheet (989 TFLOPS, 141 GB
# HBM3e 4.8 TB/s, NVLink 900 GB/s); DGX A100 (eight 200 Gb/s HDR InfiniBand ports: 25 GB/s a GPU)
# and DGX H100 (eight 400 Gb/s NDR ports: 50 GB/s a GPU) system guides. Large-GEMM fraction: cuBLAS
# reaches ~250 of 312 TFLOPS on A100 and ~700 of 989 on H100 for large fp16/bf16 shapes.
GPUS = {
    "A100-40GB": (312e12, 40 * GiB, 1.555e12, 300e9, 25e9, 0.80),
    "A100-80GB": (312e12, 80 * GiB, 2.039e12, 300e9, 25e9, 0.80),
    "H100-SXM": (989e12, 80 * GiB, 3.35e12, 450e9, 50e9, 0.72),
    "H200": (989e12, 141e9, 4.8e12, 450e9, 50e9, 0.72),
}
HBM_EFFICIENCY = 0.8        # fraction of the HBM bandwidth element-wise kernels reach
COMM_EFFICIENCY = 0.8       # fraction of the link's bandwidth NCCL's ring reaches on large messages
COMM_HALF = 4e6             # bytes at which a collective reaches half of that
LAUNCH = 4e-6               # seconds a kernel costs whatever its size
LATENCY = {"nvlink": 2e-6, "network": 8e-6}     # seconds a ring step
USABLE = 0.92               # fraction of the GPU's memory a step may hold (CUDA context, allocator)
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Cluster:
    """`gpus` GPUs, `gpus_per_node` a node, of `gpu` (a GPUS preset); any number given overrides
    the preset's: `peak` flop/s (dense 16-bit), `memory` bytes, `hbm`, `nvlink` and `network`
    bytes/s a GPU (one way), `gemm` (large matmuls' fraction of peak)."""

    gpus: int
    gpus_per_node: int = 8
    gpu: str = "H100-SXM"
    peak: float | None = None
    memory: float | None = None
    hbm: float | None = None
    nvlink: float | None = None
    network: float | None = None
    gemm: float | None = None

    def __post_init__(self):
        if not isinstance(self.gpus, int) or self.gpus < 1 or not isinstance(self.gpus_per_node, int) \
                or self.gpus_per_node < 1:
            raise ValueError(f"Cluster: gpus and gpus_per_node must be positive ints, got {self.gpus}, "
                             f"{self.gpus_per_node}")
        given = [self.peak, self.memory, self.hbm, self.nvlink, self.network, self.gemm]
        if self.gpu not in GPUS and None in given:
            raise ValueError(f"Cluster: unknown gpu {self.gpu!r}; presets are {sorted(GPUS)}, or give peak, memory, "
                             "hbm, nvlink, network and gemm")
        values = [g if g is not None else p for g, p in zip(given, GPUS.get(self.gpu, given))]
        for name, v in zip(("peak", "memory", "hbm", "nvlink", "network", "gemm"), values):
            if not v > 0:
                raise ValueError(f"Cluster.{name} must be > 0, got {v}")
            object.__setattr__(self, name, float(v))


@dataclass(frozen=True)
class Layout:
    """How a job is split: `tp` x `pp` x `dp` GPUs, `microbatch` sequences a microbatch, `interleave`
    stages a pipeline rank (Megatron's virtual stages), `sequence_parallel`, `recompute` ("none",
    "selective": attention scores, "full": each layer's activations from its input) and `fsdp`
    (parameters, gradients and optimizer state sharded over dp, FSDP2 / ZeRO-3; otherwise Megatron's
    data parallelism: replicas, gradients all-reduced)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    microbatch: int = 1
    interleave: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    fsdp: bool = False

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "microbatch", "interleave"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout.{name} must be an int >= 1, got {v!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Layout.recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.interleave > 1 and self.pp == 1:
            raise ValueError("Layout.interleave > 1 needs pp > 1 (virtual stages of a pipeline)")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def short(self) -> str:
        """One line: tp 8 pp 4 dp 2 mb 1 v 3 sp selective fsdp."""
        return (f"tp {self.tp} pp {self.pp} dp {self.dp} mb {self.microbatch}"
                + (f" v {self.interleave}" if self.interleave > 1 else "") + (" sp" if self.sequence_parallel else "")
                + (f" {self.recompute}" if self.recompute != "none" else "") + (" fsdp" if self.fsdp else ""))


@dataclass(frozen=True)
class Estimate:
    """What a step of `layout` is predicted to cost: `step_time` (seconds an optimizer step),
    `memory` (peak bytes a GPU) and `parts` of it, `tokens_per_s_per_gpu`, `mfu` (the model's
    matmul flops, recomputation not counted, over the GPUs' peak), `breakdown` (seconds: compute,
    tp_comm exposed, pipeline bubble and sends, dp_comm exposed, recompute)."""

    layout: Layout
    step_time: float
    memory: int
    parts: Mapping[str, int]
    tokens_per_s_per_gpu: float
    mfu: float
    breakdown: Mapping[str, float]
    fits: bool = True
    schedule: str = ""
    microbatches: int = 1
    notes: tuple = field(default=())

    def row(self) -> dict:
        """A table row: the layout and the predictions."""
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "mb": lay.microbatch, "v": lay.interleave,
                "sp": lay.sequence_parallel, "recompute": lay.recompute, "fsdp": lay.fsdp,
                "step s": round(self.step_time, 3), "tok/s/gpu": round(self.tokens_per_s_per_gpu),
                "mfu %": round(100 * self.mfu, 1), "memory GiB": round(self.memory / GiB, 1),
                **{f"{k} s": round(v, 3) for k, v in self.breakdown.items()}}


def matmul_time(cluster: Cluster, batch: float, m: float, n: float, k: float) -> float:
    """Seconds of `batch` matmuls (m x k) @ (k x n) in 16-bit: the roofline at the GEMM fraction."""
    flop = 2.0 * batch * m * n * k
    moved = 2.0 * batch * (m * k + k * n + m * n)
    return max(flop / (cluster.peak * cluster.gemm), moved / (cluster.hbm * HBM_EFFICIENCY)) + LAUNCH


def memory_time(cluster: Cluster, nbytes: float) -> float:
    """Seconds of an element-wise kernel moving `nbytes` through HBM."""
    return nbytes / (cluster.hbm * HBM_EFFICIENCY) + LAUNCH


def comm_time(kind: str, nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring collective `kind` on `nbytes` over `ranks`, `bandwidth` bytes/s a GPU one way."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    base, m = split_kind(kind)
    g = ranks if m is None else m
    steps = 2 * (g - 1) if base == "all_reduce" else g - 1
    message = nbytes / g if base == "all_reduce" else nbytes / max(g, 1)
    rate = bandwidth * COMM_EFFICIENCY * message / (message + COMM_HALF)
    return ring_bytes(kind, nbytes, ranks) / rate + steps * latency


def links(cluster: Cluster, layout: Layout) -> dict:
    """(bandwidth, latency) of each group's collectives, ranks ordered tp, dp, pp (Megatron's). A
    group inside a node runs on NVLink; one spanning nodes with k of its ranks a node runs NCCL's
    rings, one per NIC, whose only inter-node hop carries 1/k of the data: k times the network's
    bandwidth a GPU, at most NVLink's. Pipeline sends go GPU to GPU."""
    gpn = cluster.gpus_per_node

    def of(span: int, per_node: int):
        if span <= gpn:
            return cluster.nvlink, LATENCY["nvlink"]
        return min(cluster.nvlink, cluster.network * max(1, per_node)), LATENCY["network"]
    tp, dp = layout.tp, layout.dp
    return {"tp": of(tp, tp), "dp": of(tp * dp, min(dp, gpn // tp)), "pp": of(tp * dp * 2, 1)}
