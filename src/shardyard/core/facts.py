"""The run's derived facts: what validation and the plan learn before any worker starts, typed, with their JSON
form (the run dir's plan.json, which workers and resumes read). The floor of the house: it imports nothing of
shardyard, so every layer can name these types."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, TypedDict

META_INIT_ABOVE = 1_000_000_000  # parameters; above this `init_device: auto` builds on the meta device


@dataclass(frozen=True)
class ModelFacts:
    """What the parent learns from one meta-device build: no memory, no init. Carried to the workers."""

    params: int
    """Parameter count."""
    flops_per_token: float
    """Training FLOPs per token (``flops_per_token``)."""
    embedding_rows: int | None
    """Rows of the input embedding (the largest token id + 1 the model takes), if it has one."""
    max_positions: int | None
    """Longest sequence the model is set up for, if its config says."""
    shape: dict = dataclasses.field(default_factory=dict)
    """What the memory plan reads of the model (``shardyard.models.shape.model_shape``)."""
    attn: str | None = None
    """The HF attention implementation (``sdpa``, ``eager``, ``flash_attention_2``); None: not an HF model."""
    trainable: int | None = None
    """Parameters that train (the adapters under ``peft``); None: all of them."""
    adapter_activations: dict | None = None
    """What the adapters save for backward per token, regime -> device kind -> bytes
    (``adapters.activation_bytes_per_token``); None: no adapters."""
    moe_layers: int = 0
    """Mixture-of-experts layers (routers, ``shardyard.models.moe.routers``); 0: a dense model."""
    routed_experts: int = 0
    """Routed experts per MoE layer."""
    experts_per_token: int = 0
    """Routed experts each token goes to (top-k)."""
    router_bias: bool = False
    """The routers carry a selection bias (DeepSeek-V3's ``e_score_correction_bias``) that balancing moves."""
    attention_flops_per_token: float = 0.0
    """Of those, the attention scores' and values' matmuls (PaLM's 12*L*H*Q*T term), which run in the attention
    kernel at its own efficiency (``shardyard.planning.steptime``); 0: not counted apart."""

    @property
    def big(self) -> bool:
        return self.params > META_INIT_ABOVE


class MemoryPlan(TypedDict):
    """One rank's planned memory (``shardyard.planning.plan.estimate``), as plan.json holds it."""

    device: dict[str, float]
    """Bytes per category (params, grads, optimizer, master, buffers, activations, runtime) on the device."""
    peak: float
    """The device's planned peak, bytes."""
    line: str
    """The plan's one-line summary, printed at start."""
    where: str
    """``cuda`` or ``cpu``: where the device bytes live."""


def split_hardware(spec: str) -> tuple[int, str]:
    """``plan.hardware`` (``8xH100-80GB``, ``H100-80GB``, ``2xcpu``) as (devices per node, device name): the one
    reading of the spec, for validation (the world it plans) and the plan (the device's figures)."""
    m = re.fullmatch(r"(?:(\d+)\s*x\s*)?(.+)", spec.strip(), re.IGNORECASE)
    return (int(m.group(1)) if m and m.group(1) else 1), (m.group(2) if m else spec)


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    """Device memory as torch reports it (``total_memory``), GiB."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s (vendor data sheet, no sparsity)."""
    fp32_tflops: float
    """Dense fp32 (non-tensor-core) peak, TFLOP/s."""
    intra_gbs: float
    """Bus bandwidth of a collective between the GPUs of one node, GB/s per GPU per direction (NVLink)."""
    inter_gbs: float
    """Between nodes, GB/s per GPU (the usual one NIC per GPU: 400 Gb/s InfiniBand NDR = 50 GB/s)."""
    host_gib_per_gpu: float = 256.0
    """Host RAM per GPU of the usual server (a DGX H100: 2 TiB for 8 GPUs)."""
    hbm_tbs: float = 0.0
    """Device memory bandwidth, TB/s (data sheet): what bounds the step's memory-bound ops and small matmuls
    (``shardyard.planning.steptime``); 0: unknown."""
    pcie_gbs: float = 32.0
    """The host link, GB/s per direction (PCIe Gen5 x16: 64, Gen4 x16: 32): what offload's copies cross."""
    source: str = ""
    """Where each figure of this row comes from (the data sheet, or how it was derived)."""
    matmul_efficiency: float = 0.0
    """The share of the peak a large matmul reaches on this part, where a published run of it fitted one
    (``shardyard.planning.steptime``); 0: the step-time model's ``MATMUL_EFFICIENCY``, fitted on H100."""


A100_MATMUL_EFFICIENCY = 0.82
"""A100's matmul efficiency, fitted to torchtitan's Llama 3 8B on 64 A100-80GB (8 nodes; its docs/performance.md:
FSDP, local batch 1, seq 8,192, selective op checkpointing, 2,973 tokens/s/GPU, 58.2% MFU: 2,957 predicted),
where H100's 0.55 predicted 2,355 (-21%); checked on its Llama 3 70B on the same 64 GPUs (full checkpointing, 331
published, 313 predicted, -5.6%; -29% at 0.55): docs/plan.md's table."""

GPUS = [
    GPU("H100-80GB", 79.1, 989.4, 66.9, 450.0, 50.0, hbm_tbs=3.35, pcie_gbs=64.0,
        source="NVIDIA H100 Tensor Core GPU data sheet (SXM5, 700 W): 989.4 TFLOP/s dense BF16, 66.9 FP32, HBM3 "
               "3.35 TB/s, NVLink 4 900 GB/s both directions (450 each way), PCIe Gen5 x16; DGX H100 user guide: one "
               "ConnectX-7 400 Gb/s NDR InfiniBand port per GPU (50 GB/s)"),
    GPU("H100-PCIe-80GB", 79.1, 756.0, 51.2, 64.0, 25.0, 128.0, hbm_tbs=2.0, pcie_gbs=64.0,
        source="NVIDIA H100 data sheet (PCIe, 350 W): 756 TFLOP/s dense BF16, 51.2 FP32, HBM2e 2.0 TB/s; GPUs of a "
               "node talk over PCIe Gen5 x16 (64 GB/s each way); a 200 Gb/s NIC per GPU (25 GB/s) assumed"),
    GPU("H100-96GB-500W", 95.1, 886.5, 60.0, 450.0, 50.0, hbm_tbs=2.4, pcie_gbs=64.0,
        source="the part of torchtitan's published runs (arXiv 2410.06511; its docs/performance.md: Grand Teton "
               "hosts, H100 with 96 GB HBM2e at 2.4 TB/s, held to its default 500 W power limit, 400 Gb/s RDMA per "
               "GPU). No data sheet gives its peak at 500 W: 886.5 TFLOP/s dense BF16 is interpolated by power "
               "between two NVIDIA data sheets of the same GH100 die, the H100 NVL (835 at 400 W) and the H100 "
               "SXM5 (989.4 at 700 W); FP32 scaled alike. Not the 700 W, 80 GB part of most clusters: plan those "
               "with H100-80GB"),
    GPU("H200-141GB", 139.8, 989.4, 66.9, 450.0, 50.0, hbm_tbs=4.8, pcie_gbs=64.0,
        source="NVIDIA H200 data sheet (SXM, 700 W): 989.4 TFLOP/s dense BF16, HBM3e 4.8 TB/s, NVLink 4 900 GB/s "
               "(450 each way), PCIe Gen5; 400 Gb/s NDR per GPU (50 GB/s)"),
    GPU("B200-192GB", 178.4, 2250.0, 80.0, 900.0, 50.0, 512.0, hbm_tbs=8.0, pcie_gbs=64.0,
        source="NVIDIA HGX B200 data sheet: 2.25 PFLOP/s dense BF16 per GPU, HBM3e 8 TB/s, NVLink 5 1.8 TB/s (900 "
               "each way), PCIe Gen5 (the Gen6 link is not assumed); 400 Gb/s per GPU (50 GB/s)"),
    GPU("A100-80GB", 79.2, 312.0, 19.5, 300.0, 25.0, 256.0, hbm_tbs=2.039, pcie_gbs=32.0,
        source="NVIDIA A100 data sheet (SXM4 80GB): 312 TFLOP/s dense BF16, 19.5 FP32, HBM2e 2.039 TB/s, NVLink 3 "
               "600 GB/s (300 each way), PCIe Gen4; DGX A100: 200 Gb/s HDR per GPU (25 GB/s)",
        matmul_efficiency=A100_MATMUL_EFFICIENCY),
    GPU("A100-40GB", 39.4, 312.0, 19.5, 300.0, 25.0, 128.0, hbm_tbs=1.555, pcie_gbs=32.0,
        source="NVIDIA A100 data sheet (SXM4 40GB): 312 TFLOP/s dense BF16, HBM2 1.555 TB/s, NVLink 3 600 GB/s; "
               "200 Gb/s HDR per GPU", matmul_efficiency=A100_MATMUL_EFFICIENCY),
    GPU("L40S-48GB", 44.4, 362.0, 91.6, 32.0, 12.5, 96.0, hbm_tbs=0.864, pcie_gbs=32.0,
        source="NVIDIA L40S data sheet: 362 TFLOP/s dense BF16, 91.6 FP32, GDDR6 864 GB/s, PCIe Gen4 x16 (no "
               "NVLink: 32 GB/s each way between GPUs); 100 Gb/s per GPU (12.5 GB/s) assumed"),
    GPU("MI300X-192GB", 191.5, 1307.4, 163.4, 448.0, 50.0, 256.0, hbm_tbs=5.3, pcie_gbs=64.0,
        source="AMD Instinct MI300X data sheet: 1307.4 TFLOP/s dense BF16, 163.4 FP32, HBM3 5.3 TB/s, Infinity "
               "Fabric 896 GB/s per GPU (448 each way), PCIe Gen5; 400 Gb/s per GPU (50 GB/s)"),
]


def find_gpu(name: str) -> GPU | None:
    """The GPU of ``GPUS`` that ``plan.hardware``'s device name names (``H100-80GB``, or ``h100`` for the first
    ``H100-...``), or None."""
    return next((g for g in GPUS if g.name.lower() == name.lower()), None) or \
        next((g for g in GPUS if g.name.lower().startswith(name.lower() + "-")), None)


MAX_NODES = 4096
"""The most nodes the plan searches (``plan.nodes_needed``, validation's node counts): 32,768 GPUs at 8 a node."""


def node_counts(usable: Callable[[int], bool], most: int = MAX_NODES) -> list[int]:
    """Every node count from 1 to ``most`` (at most ``MAX_NODES``) that ``usable`` accepts, in order: the one search
    over node counts, for validation (the counts a recipe's layout and global batch can use) and the plan (the
    counts to look for a fit among). A layout's test is arithmetic on its degrees (microseconds), so the whole
    range is searched rather than a guess around the count given."""
    return [n for n in range(1, min(most, MAX_NODES) + 1) if usable(n)]


def nearest(counts: list[int], n: int, k: int = 12) -> list[int]:
    """The ``k`` of ``counts`` nearest ``n`` (ties: the smaller), in order."""
    return sorted(sorted(counts, key=lambda c: (abs(c - n), c))[:k])


@dataclass(frozen=True)
class ParallelDims:
    """How the world's ranks are laid out, one degree per kind of parallelism (torchtitan's ``ParallelDims``):
    ``world_size = dp_replicate x dp_shard x sp x cp x tp x pp``. Derived once, at validation, from the launch, the
    engine's ``degrees`` and ``plan.hardware`` (``shardyard.backends.parallel_dims``); everything else reads it."""

    world_size: int
    """Ranks of the run (every node's)."""
    dp_replicate: int = 1
    """Data-parallel ranks that each hold the whole model (DDP, Horovod, ZeRO-1/2) and read different batches."""
    dp_shard: int = 1
    """Data-parallel ranks that shard the parameters among them (FSDP, ZeRO-3) and read different batches."""
    tp: int = 1
    """Tensor parallel: ranks that split every layer's matrices (``backend.tp``), consecutive ranks on one node."""
    pp: int = 1
    """Pipeline parallel: ranks that each hold a stage of the layers (``backend.stages``)."""
    sp: int = 1
    """Sequence parallel, Ulysses style (``backend.sp``): consecutive ranks that read the same batch and each hold
    a contiguous shard of its positions, trading them for shards of the heads around attention
    (``shardyard.backends.sequence_parallel``). Their gradients are averaged as data-parallel ranks' are."""
    cp: int = 1
    """Context parallel, all-gather style (``backend.cp``): consecutive ranks (beside tensor parallel: those of one tp
    index) that read the same batch and each hold two chunks of its positions (head and tail), gathering every rank's
    keys and values around attention (``shardyard.backends.sequence_parallel``). Their gradients are averaged as
    data-parallel ranks' are."""
    ep: int = 1
    """Expert parallel: ranks that split a mixture-of-experts layer's experts. As in torchtitan it borrows ranks
    from ``dp_shard x cp`` rather than multiplying the world, so it is not a factor of ``world_size`` (``fsdp``,
    ``fsdp_offload`` and ``pipeline`` set it from ``backend.ep``)."""

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the ranks that read different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """The ranks of one copy that shard the parameters, ``dp_shard x sp x cp`` (a sequence group's ranks shard
        them with the others): what expert parallelism borrows its groups from (``ep`` must divide it)."""
        return self.dp_shard * self.sp * self.cp

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one model replica together (tensor parallel x pipeline stages)."""
        return self.tp * self.pp

    @property
    def product(self) -> int:
        """The degrees' product, which a valid layout has equal to ``world_size``."""
        return self.dp_replicate * self.dp_shard * self.sp * self.cp * self.tp * self.pp

    @classmethod
    def of(cls, world_size: int, degrees: dict[str, int | None]) -> ParallelDims:
        """The layout of ``world_size`` ranks under an engine's ``degrees`` (field -> degree); the degree given
        as None (``dp_replicate`` if none is) takes the ranks the others leave: world / their product (at least
        1: whether they divide the world is validation's check, ``ParallelDims.product``)."""
        rest = next((k for k, v in degrees.items() if v is None), "dp_replicate")
        fixed = {k: v for k, v in degrees.items() if v is not None}
        known = 1
        for k, v in fixed.items():
            known *= max(v, 1) if k != "ep" else 1  # expert parallel borrows its ranks
        return cls(world_size, **{**fixed, rest: max(1, world_size // known)})

    def describe(self) -> str:
        """``world 8 = dp_shard 2 x tp 4``: the degrees above 1."""
        parts = [f"{k} {getattr(self, k)}" for k in ("dp_replicate", "dp_shard", "sp", "cp", "tp", "pp", "ep")
                 if getattr(self, k) > 1]
        return f"world {self.world_size} = {' x '.join(parts) or 'one rank'}"


@dataclass(frozen=True)
class Plan:
    """Numbers derived from the config and the launch; printed at start, used by every worker."""

    device_type: str
    nproc_per_node: int
    world_size: int
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    seq_len: int
    dims: ParallelDims
    """How the ranks are laid out (data-parallel replicate/shard, tensor, pipeline ...)."""
    nnodes: int = 1
    sequences_per_sample: int = 1
    """Sequences the model runs per sample of the batch: 1, DPO's 2 (chosen and rejected), GRPO's G completions."""
    sequence_len: int = 0
    """Tokens of each of them; 0: ``seq_len`` (GRPO: the prompt's ``seq_len`` plus ``max_new_tokens``)."""
    model: ModelFacts | None = None
    """What one meta-device build (parameters, FLOPs/token, ...)."""
    memory: MemoryPlan | None = None
    """The memory plan's figures for one rank of this run, set before launch (``plan.before_launch``); the worker
    reports its measured peak beside it."""

    @property
    def facts(self) -> ModelFacts:
        """``model``, which validation sets before any worker starts."""
        assert self.model is not None, "Plan.model is set by validate()"
        return self.model

    @property
    def memory_line(self) -> str:
        return self.memory["line"] if self.memory else ""

    @property
    def tokens_per_sample(self) -> int:
        """Tokens the model runs per sample of the batch (``sequences_per_sample`` x ``sequence_len``)."""
        return self.sequences_per_sample * (self.sequence_len or self.seq_len)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.tokens_per_sample

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the ranks that read different batches."""
        return self.dims.dp

    @property
    def model_parallel(self) -> int:
        """Ranks holding one model replica together (tensor parallel x pipeline stages); 1 on the data-parallel
        engines."""
        return self.dims.model_parallel

    def describe(self) -> str:
        nodes = f" x {self.nnodes} nodes" if self.nnodes > 1 else ""
        replicas = (f"data-parallel {self.dp_size} (world {self.world_size} / model-parallel {self.model_parallel})"
                    if self.model_parallel > 1 else
                    f"data-parallel {self.dp_size} (world {self.world_size} / sequence groups of "
                    f"{self.dims.sp * self.dims.cp}, each rank 1/{self.dims.sp * self.dims.cp} of every sequence)"
                    if self.dims.sp * self.dims.cp > 1 else f"world {self.world_size}")
        return (f"world size {self.world_size} ({self.nproc_per_node}/node{nodes} on {self.device_type}) | "
                f"global batch {self.global_batch_size} = micro {self.micro_batch_size} x accumulation "
                f"{self.grad_accum_steps} x {replicas} | seq_len {self.seq_len} | "
                f"tokens/step {self.tokens_per_step:,}")


def to_json(p: Plan) -> dict:
    return dataclasses.asdict(p)


def from_json(d: dict) -> Plan:
    return Plan(**{**d, "dims": ParallelDims(**d["dims"]),
                   "model": ModelFacts(**d["model"]) if d.get("model") else None})
