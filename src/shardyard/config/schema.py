"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Each YAML option in ``conf/<group>/`` starts with ``defaults: [/schema_<group>_<kind>@_here_]``, so a
misspelt key or a wrong type fails at composition and Hydra names the full key. Dataclass inheritance
here only shares *fields* (data), never behaviour. A string literal after a field is its documentation.

This module must stay import-light (no torch): ``python train.py --help`` composes through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from omegaconf import MISSING


class Choice(str, Enum):
    """A closed choice: OmegaConf refuses any other value at composition and lists the allowed ones.
    Members compare equal to their names (``Precision.bf16 == "bf16"``), and configs written for workers
    hold plain strings."""

    def __str__(self) -> str:
        return self.value


class Device(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DistBackend(Choice):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class Offload(Choice):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class Compression(Choice):
    none = "none"
    fp16 = "fp16"


class HorovodController(Choice):
    auto = "auto"
    gloo = "gloo"
    mpi = "mpi"


class AttnImplementation(Choice):
    sdpa = "sdpa"
    eager = "eager"
    flash_attention_2 = "flash_attention_2"


class TopkMethod(Choice):
    greedy = "greedy"
    group_limited_greedy = "group_limited_greedy"


class RopeType(Choice):
    none = "none"
    yarn = "yarn"
    linear = "linear"
    dynamic = "dynamic"
    llama3 = "llama3"


class InitDevice(Choice):
    auto = "auto"
    cpu = "cpu"
    meta = "meta"


class Precision(Choice):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"


class NanPolicy(Choice):
    stop = "stop"
    skip = "skip"
    off = "off"


class ConsoleStyle(Choice):
    auto = "auto"
    rich = "rich"
    plain = "plain"


class Direction(Choice):
    auto = "auto"
    minimize = "minimize"
    maximize = "maximize"


class WandbMode(Choice):
    auto = "auto"
    online = "online"
    offline = "offline"
    disabled = "disabled"


# ------------------------------------------------------------------------------------------ value ranges
@dataclass(frozen=True)
class Range:
    """The values a numeric key may take, and the engine setting it becomes. ``RANGES`` (below) holds them by
    schema; ``config.validate`` refuses a value outside (exit 2, naming the key and that setting) before any
    engine starts: DeepSpeed's own checks would refuse it later as a traceback, or not at all."""

    low: float
    """The smallest value allowed."""
    above: bool = False
    """``low`` itself is excluded (the value must be greater)."""
    high: Optional[float] = None
    """The largest value allowed; ``None``: no bound."""
    multiple_of: Optional[int] = 1
    """The value must be a whole multiple of this (1: a whole number); ``None``: any real number."""
    becomes: str = ""
    """The engine setting the key becomes (a DeepSpeed JSON key, a torch argument), named in the refusal."""


# --------------------------------------------------------------------------------------------- backend
@dataclass
class BackendConfig:
    _target_: str = MISSING
    """Import path of the engine class implementing ``shardyard.backends.Backend``."""
    name: str = MISSING
    """Engine name, shown in logs and stored in checkpoints."""
    device: Device = Device.auto
    """``auto`` (cuda if available, else cpu), ``cpu`` or ``cuda``."""
    ep: int = 1
    """Expert-parallel degree: a mixture-of-experts layer's routed experts split over this many ranks
    (``n_routed_experts / ep`` each), tokens sent to them by all-to-all. It borrows its ranks from the
    data-parallel shards (it must divide them and the experts). Engines that shard experts: ``fsdp``,
    ``fsdp_offload`` and ``pipeline`` (per stage); the others refuse ``ep > 1``."""
    ep_capacity_factor: Optional[float] = None
    """Expert parallelism's receive bound: a rank of an EP group may receive at most this many times its
    balanced share of token rows (the group's rows / ep; a row is a token sent to one rank holding any of its
    experts) in a MoE layer, or the run stops with an error naming it (a router collapsed onto few experts).
    ``null``: no bound (dropless, as DeepSeek-V3 trains). Greater than 1; ``ep`` or more never binds. Needs
    ``ep > 1``."""
    sp: int = 1
    """Sequence-parallel degree, Ulysses style (DeepSpeed-Ulysses, arXiv 2309.14509): this many consecutive ranks
    read the same sequences and each holds 1/sp of their positions (its activations, its share of the loss); around
    each attention an all-to-all trades the sequence shards for shards of the heads, so a rank attends over the
    whole sequence with 1/sp of the heads, and a second one trades them back. Exact: the same loss and gradients
    as one rank holding the whole sequence. It must divide the attention heads, ``data.seq_len`` and the world;
    the data-parallel size (the ranks reading different batches) is the world / sp. Engines: ``ddp``, ``fsdp``
    (with HSDP's ``replicate``), ``fsdp_offload`` and ``zero1/2/3``; objective ``lm``
    (``shardyard.backends.sequence_parallel``; docs/long_context.md)."""
    cp: int = 1
    """Context-parallel degree, all-gather style (Llama 3's, torch's ``flex_cp_allgather``): this many consecutive
    ranks read the same sequences, and each holds two of their 2 x cp chunks of positions, chunk r and chunk
    2 cp - 1 - r (every rank then has the same causal work); each attention gathers every rank's keys and values
    (their gradients reduce-scattered back) and the rank's queries attend to them. Any head count (where Ulysses'
    ``sp`` needs heads that divide), but a rank holds a layer's whole-sequence keys and values while it attends and
    until its backward (activation checkpointing bounds that to one layer). Exact, as ``sp``. It must divide the
    world, and 2 x cp ``data.seq_len``; not with ``sp`` at once. Engines and objective: as ``sp``, and ``pipeline``
    (each stage's cp ranks among its data-parallel ones) and ``fsdp_tp`` (beside tp: the ranks of one tp index)."""


BACKEND_RANGES = {"ep": Range(1, becomes="the expert-parallel degree (ranks per expert group)"),
                  "sp": Range(1, becomes="the sequence-parallel degree (ranks per sequence)"),
                  "cp": Range(1, becomes="the context-parallel degree (ranks per sequence)")}


@dataclass
class DDPBackendConfig(BackendConfig):
    dist_backend: DistBackend = DistBackend.auto
    """Process-group backend: ``auto`` = nccl on CUDA, gloo on CPU."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB (bigger buckets: fewer, larger all-reduces)."""
    find_unused_parameters: bool = False
    """Traverse the autograd graph each step to find parameters without gradients (slow; MoE may need it)."""
    static_graph: bool = False
    """Promise DDP the set of used parameters never changes, enabling its static-graph optimisations."""
    gradient_as_bucket_view: bool = True
    """Let gradients alias the all-reduce buckets (saves one gradient-sized copy)."""
    forward_sync_buffers: bool = False
    """Re-broadcast module buffers from rank 0 every forward (LLMs have no BatchNorm: not needed)."""


FSDP_RANGES = {"replicate": Range(1, becomes="HSDP's copies of the sharded model (the 2-D mesh's outer dimension)")}

DDP_RANGES = {"bucket_cap_mb": Range(0, above=True, multiple_of=None, becomes="DistributedDataParallel(bucket_cap_mb)")}


@dataclass
class FSDPBackendConfig(BackendConfig):
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (ZeRO-3 memory) instead of keeping them
    for backward (ZeRO-2-like: less communication, more memory)."""
    replicate: int = 1
    """HSDP (hybrid sharding): copies of the sharded model. FSDP2 then runs on a 2-D mesh, ``replicate x shard``:
    parameters, gradients and optimizer state are sharded over ``world / replicate`` consecutive ranks (a node,
    when that is the node's size, so the all-gathers stay on its links), each of the ``replicate`` groups holds
    a whole copy, and gradients are reduce-scattered within a group and all-reduced across the copies (one
    gradient shard's bytes cross the nodes instead of every all-gather). 1: plain FSDP over every rank. It must
    divide the world size. Every FSDP2 engine: with ``fsdp_tp`` the copies are of the (shard x tp) ranks
    (mesh ``replicate x dp x tp``), with ``pipeline`` of each stage's shard group (``pp x replicate x dp``), and
    with ``backend.ep`` the expert-parallel groups are made of one copy's shards (``replicate x edp x ep``: the
    experts are sharded over edp and all-reduced across the copies, as the rest is)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (``CPUOffloadPolicy``)."""
    reduce_every_micro_batch: bool = True
    """With gradient accumulation, reduce-scatter the gradients after every micro-batch, so that a rank only
    ever holds its gradient shard (4P/N bytes). ``false`` reduces once per step (micro-batches x fewer
    reduce-scatters) but keeps the whole model's unsharded fp32 gradients on every rank while accumulating
    (4P bytes: 26 GiB for a 7B model)."""


@dataclass
class FSDPTPBackendConfig(FSDPBackendConfig):
    tp: int = 2
    """Tensor-parallel degree: ranks each block's matmuls are split across (consecutive ranks, so inside one
    node). The world size must be a multiple; world / tp ranks are the FSDP (data-parallel) replicas."""


# OmegaConf matches a choice by member *name*, and "1f1b" is not an identifier: the functional form allows it.
PipelineSchedule = Choice("PipelineSchedule", {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved"})  # type: ignore[call-overload]


@dataclass
class PipelineBackendConfig(FSDPBackendConfig):
    stages: int = 2
    """Pipeline degree: ranks the layers are split across (the embedding on the first, the final norm and LM
    head on the last). The world size must be a multiple; world / stages ranks are each stage's FSDP replicas."""
    schedule: PipelineSchedule = PipelineSchedule["1f1b"]  # type: ignore[valid-type]
    """``gpipe`` (all forwards, then all backwards: every micro-batch's activations alive at once), ``1f1b``
    (at most ``stages`` micro-batches in flight) or ``interleaved`` (1F1B over ``virtual_stages`` chunks per
    rank: a smaller bubble for more point-to-point messages)."""
    microbatches: int = 2
    """Pipeline micro-batches each ``train.micro_batch_size`` batch is split into (it must divide it). The bubble
    is (stages - 1) / (microbatches + stages - 1) of the step for gpipe and 1f1b."""
    virtual_stages: int = 2
    """``schedule=interleaved``: model chunks per rank (stage i holds chunks i, i + stages, ...)."""


@dataclass
class ZeroBackendConfig(BackendConfig):
    stage: int = MISSING
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward compute."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter instead of all-reduce (stages 1-2)."""
    reduce_bucket_size: float = 5e8
    """Elements reduced at a time."""
    allgather_bucket_size: float = 5e8
    """Elements all-gathered at a time after the optimizer step (stages 1-2)."""
    stage3_prefetch_bucket_size: float = 5e7
    """ZeRO-3: elements of upcoming parameters prefetched ahead of use."""
    stage3_param_persistence_threshold: float = 1e5
    """ZeRO-3: parameters smaller than this stay unpartitioned (fewer tiny all-gathers)."""
    stage3_max_live_parameters: float = 1e9
    """ZeRO-3: most gathered parameter elements kept on a GPU at once."""
    stage3_max_reuse_distance: float = 1e9
    """ZeRO-3: keep a gathered parameter if it is reused within this many elements of compute."""
    stage3_gather_16bit_weights_on_model_save: bool = True
    """ZeRO-3: gather full 16-bit weights when the model is saved (needed for the HF export)."""
    sub_group_size: float = 1e9
    """ZeRO-3: optimizer steps run over parameter groups of this many elements (bounds offload memory)."""
    offload_optimizer: Offload = Offload.none
    """``none``, ``cpu`` (ZeRO-Offload) or ``nvme`` (ZeRO-Infinity) for optimizer state and step."""
    offload_param: Offload = Offload.none
    """ZeRO-3 only: ``none``, ``cpu`` or ``nvme`` for the partitioned parameters."""
    pin_memory: bool = True
    """Page-locked CPU buffers for offloaded tensors (faster host-device copies)."""
    nvme_path: Optional[str] = None
    """ZeRO-Infinity: a directory on fast local storage for swapped tensors. Each run swaps into its own
    subdirectory (``shardyard-swap-<run>``), removed when the run ends."""
    nvme_buffer_count: int = 5
    """ZeRO-Infinity: pinned host buffers for parameters in flight between disk and device (DeepSpeed's
    ``offload_param.buffer_count``); more buffers overlap more reads with compute."""
    nvme_buffer_size: float = 1e8
    """ZeRO-Infinity: elements per parameter swap buffer (``offload_param.buffer_size``); must hold the largest
    parameter."""
    nvme_optimizer_buffer_count: int = 4
    """ZeRO-Infinity: pinned buffers for optimizer state being swapped (``offload_optimizer.buffer_count``)."""
    aio_block_size: int = 1048576
    """Async I/O: bytes per read/write request to the disk."""
    aio_queue_depth: int = 8
    """Async I/O: requests kept in flight per thread (NVMe drives want deep queues)."""
    aio_thread_count: int = 1
    """Async I/O: threads submitting requests per rank (DeepSpeed's ``intra_op_parallelism``)."""
    aio_single_submit: bool = False
    """Async I/O: submit requests one at a time instead of in batches."""
    aio_overlap_events: bool = True
    """Async I/O: overlap submitting new requests with waiting for finished ones."""
    dump_config: bool = False
    """Print the generated DeepSpeed JSON at start (it is always written to ``<run_dir>/deepspeed_config.json``)."""
    wall_clock_breakdown: bool = False
    """DeepSpeed's per-phase timers (forward, backward, step, and the communication inside them), printed
    by DeepSpeed every ``train.log_every_n_steps`` steps."""
    flops_profiler: bool = False
    """DeepSpeed's flops profiler: per-module FLOPs, parameters and latency of one step, written to
    ``<run_dir>/deepspeed_flops_profile.txt``."""
    flops_profiler_step: int = 2
    """The optimizer step (1-based) the flops profiler measures."""


ZERO_RANGES = {
    # DeepSpeed 0.19: runtime/zero/config.py (pydantic Field gt/ge), offload_config.py, and stage_1_and_2.py,
    # which asserts the all-gather bucket is a multiple of 2 and divides by it.
    "reduce_bucket_size": Range(0, above=True, becomes="zero_optimization.reduce_bucket_size"),
    "allgather_bucket_size": Range(0, above=True, multiple_of=2, becomes="zero_optimization.allgather_bucket_size"),
    "stage3_prefetch_bucket_size": Range(0, becomes="zero_optimization.stage3_prefetch_bucket_size"),
    "stage3_param_persistence_threshold": Range(0, becomes="zero_optimization.stage3_param_persistence_threshold"),
    "stage3_max_live_parameters": Range(0, becomes="zero_optimization.stage3_max_live_parameters"),
    "stage3_max_reuse_distance": Range(0, becomes="zero_optimization.stage3_max_reuse_distance"),
    "sub_group_size": Range(0, becomes="zero_optimization.sub_group_size"),
    # ZeRO-Infinity: DeepSpeed allows 0 buffers and 0-byte requests, with which no tensor can be swapped.
    "nvme_buffer_count": Range(1, becomes="zero_optimization.offload_param.buffer_count"),
    "nvme_buffer_size": Range(1, becomes="zero_optimization.offload_param.buffer_size"),
    "nvme_optimizer_buffer_count": Range(1, becomes="zero_optimization.offload_optimizer.buffer_count"),
    "aio_block_size": Range(1, becomes="aio.block_size"),
    "aio_queue_depth": Range(1, becomes="aio.queue_depth"),
    "aio_thread_count": Range(1, becomes="aio.intra_op_parallelism"),
    "flops_profiler_step": Range(1, becomes="flops_profiler.profile_step (this minus 1)"),
}


@dataclass
class HorovodBackendConfig(BackendConfig):
    compression: Compression = Compression.none
    """Gradient compression on the wire: ``none`` or ``fp16`` (halves all-reduce bytes)."""
    timeline: bool = False
    """Write Horovod's timeline (Chrome-trace JSON) to ``<run_dir>/horovod_timeline.json``."""
    controller: HorovodController = HorovodController.auto
    """How Horovod's workers coordinate. ``gloo``: our launcher starts them with ``horovodrun --gloo`` (always
    built). ``mpi``: with ``horovodrun --mpi`` (needs Open MPI and a Horovod built with it; ``make setup``
    builds it so when ``mpicc`` is present). ``auto``: MPI when the workers were started by ``mpirun`` or
    ``horovodrun --mpi``, Gloo otherwise (our launcher, ``horovodrun --gloo``)."""


# ----------------------------------------------------------------------------------------------- model
@dataclass
class BalanceConfig:
    """How a mixture-of-experts model's routing is kept balanced in training (``shardyard.models.moe``); a dense model
    has no router and uses none of it. Each key's default is off here; the DeepSeek families set their papers'
    values (``DeepseekV3ModelConfig``, ``DeepseekV2ModelConfig``), and a model option may set its own. 0 turns
    each mechanism off."""

    bias_update_speed: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing (gamma): after each optimizer step every router's selection
    bias moves by ``gamma * sign(mean load - expert load)``, the loads counted over the whole global batch.
    Only routers with a selection bias (``e_score_correction_bias``, DeepSeek-V3's) have one to move."""
    seq_aux_alpha: float = 0.0
    """Weight of the sequence-wise balance loss ``alpha * sum_i f_i P_i`` (DeepSeek-V3's complementary loss;
    DeepSeek-V2's expert-level loss, alpha_1, computed per sequence as its released models do)."""
    device_aux_alpha: float = 0.0
    """DeepSeek-V2's device-level balance loss (alpha_2) over the expert-parallel groups; no effect at ep 1."""
    comm_aux_alpha: float = 0.0
    """DeepSeek-V2's communication balance loss (alpha_3) over the expert-parallel groups; no effect at ep 1."""
    warn_max_over_mean: float = 2.0
    """Training-health warning when a MoE layer's busiest expert gets more than this many times the mean load
    at 5 log steps in a row, after the first tenth of the run (top-k of E routes at most E / k)."""


BALANCE_RANGES = {**{k: Range(0, multiple_of=None, becomes=what) for k, what in (
    ("bias_update_speed", "gamma, the step of DeepSeek-V3's bias update"), ("seq_aux_alpha", "alpha, a loss weight"),
    ("device_aux_alpha", "alpha_2, a loss weight"), ("comm_aux_alpha", "alpha_3, a loss weight"))},
    "warn_max_over_mean": Range(1, multiple_of=None, becomes="max/mean, which is never below 1")}


@dataclass
class V3BalanceConfig(BalanceConfig):
    bias_update_speed: float = 0.001
    """DeepSeek-V3's gamma (0.001 for most of its training: section 4.2)."""
    seq_aux_alpha: float = 0.0001
    """DeepSeek-V3's sequence-wise balance loss weight (0.0001: section 4.2)."""


@dataclass
class V2BalanceConfig(BalanceConfig):
    seq_aux_alpha: float = 0.003
    """DeepSeek-V2's expert-level balance loss weight alpha_1 (0.003: section 3.1.2)."""
    device_aux_alpha: float = 0.05
    """DeepSeek-V2's device-level balance loss weight alpha_2 (0.05)."""
    comm_aux_alpha: float = 0.02
    """DeepSeek-V2's communication balance loss weight alpha_3 (0.02)."""


@dataclass
class MTPConfig:
    """DeepSeek-V3's multi-token prediction (``shardyard.models.mtp``; arXiv 2412.19437, section 2.2): ``depth`` extra
    modules, each predicting one token further ahead through the shared embedding and output head. The loss is
    the main loss plus ``weight / depth`` times the sum of the depths' losses. Training only: evaluation, sampling
    and the export's main model ignore it (the export keeps the modules under DeepSeek's own names)."""

    depth: int = 0
    """MTP depths D (DeepSeek-V3: 1); 0 = off. DeepSeek-V3 models only (``model.layers.{num_layers + k - 1}``)."""
    weight: float = 0.3
    """lambda, the MTP losses' weight (DeepSeek-V3: 0.3 for its first 10T tokens)."""
    final_weight: Optional[float] = None
    """lambda from ``final_weight_from_step`` on (DeepSeek-V3: 0.1 for its last 4.8T tokens); ``null``: ``weight``
    throughout."""
    final_weight_from_step: Optional[int] = None
    """The training step (counted from 1) from which ``final_weight`` applies."""


@dataclass
class ModelConfig:
    """What shardyard itself reads of every ``model`` option. Every other key of the option is an argument
    of its ``_target_``, a builder returning the model (``shardyard.models.build.CausalLM``)."""

    _target_: str = MISSING
    """Builder: a callable that takes the option's other keys and returns a ``transformers.PreTrainedModel``
    or any ``nn.Module`` meeting ``shardyard.models.build.CausalLM`` (e.g. ``shardyard.models.build.llama`` or your own
    ``mypkg.models.build``)."""
    name: str = MISSING
    """Human-readable model name (logs, summaries)."""
    activation_checkpointing: Any = False
    """What transformer blocks keep for backward (non-reentrant checkpointing): ``none`` (or ``false``): every
    activation; ``full`` (or ``true``): only each block's input, the block recomputed in backward (least memory,
    about a third more compute); ``selective``: each block keeps its matmul and attention outputs and recomputes
    the cheap ops between them (norms, activations, rotary, products): memory between the two for little
    recompute (torch's selective checkpoint policy, ``shardyard.models.prepare._saved_ops``); not on ZeRO-3, whose
    parameter hooks run inside the blocks."""
    activation_checkpointing_every: int = 1
    """Checkpoint every k-th transformer block only (``full`` or ``selective``): 1 = every block; 2 = half of
    them, trading memory for less recompute. The plan counts the blocks it checkpoints."""
    compile: bool = False
    """Regional compile: each transformer block in ``torch.compile`` (inductor), not the whole model, so one graph
    serves every identical block and the engine's hooks (FSDP's all-gathers, DDP's buckets) stay outside it.
    single, ddp, horovod, fsdp, pipeline and ZeRO-1/2; refused on ZeRO-3 (its parameter hooks run inside the
    blocks) and fsdp_tp (inductor's tensor-parallel blocks train differently from eager on torch 2.13). The
    first steps pay the compile (cached in ``/tmp/torchinductor_<user>``)."""
    loss_chunk: int = 0
    """Chunked cross-entropy: the LM head and the loss run on this many tokens at a time, each chunk
    recomputed in backward, so the full ``tokens x vocab`` fp32 logits (and their gradient) never exist; the
    loss is the same sum (within 1e-5). 0 = off (one matmul over the micro-batch). Worth it at large
    vocabularies: at vocab 128k and 8k tokens per micro-batch the logits alone take 4 GiB in fp32. The plan
    counts one chunk. Not on fsdp_tp (sharded head) or pipeline."""
    mlp_tiles: int = 0
    """Tiled MLP (ALST's TiledMLP, issue 56): each dense transformer block's MLP computes its tokens in this many
    tiles, each recomputed in backward, so the MLP's intermediates (gate, up, activation and product: 4 x its width
    per token) are not kept for backward and at most one tile's exist at a time; the output and gradients equal the
    untiled ones within rounding, for one more forward of the MLP's matmuls. 0 or 1 = off. Worth it at long
    sequences, where a block's MLP intermediates are about half of what it keeps (DeepSeek-7B: 8 x 11,008 of
    ~200k bytes per token in bf16). Routed-expert (MoE) blocks are not tiled. With ``activation_checkpointing``
    ``none`` or ``full`` (not selective, which keeps the MLP's matmul outputs), not with ``compile``, ``peft`` or
    fp8; not on fsdp_tp or pipeline. The plan counts it."""
    norm_tiles: int = 0
    """Tiled norms: each transformer block's own norms (``input_layernorm``, ``post_attention_layernorm``) compute
    their tokens in this many tiles, each recomputed in backward (as ``mlp_tiles`` does for the MLP), so RMSNorm's
    fp32 intermediates and their gradients (its upcast, square, scale: hidden x 4 bytes per token each) exist for
    one tile at a time. 0 or 1 = off. At long sequences under full checkpointing they are most of what a recomputed
    block's backward holds (DeepSeek-7B in bf16: 28 of 44 x hidden bytes per token, by the dry run). Exact within
    rounding; with ``activation_checkpointing`` ``none`` or ``full``, not with ``compile``; not on fsdp_tp or
    pipeline. The plan counts it."""
    activation_offload: bool = False
    """With ``activation_checkpointing=full``: each checkpointed block's input (what full checkpointing keeps of
    it until its backward, the residual stream: hidden x 2 bytes per token in bf16) is copied to host RAM as the
    block's forward ends, and back to the GPU for its recompute (ALST's offload of the checkpointed hidden states),
    so the GPU no longer holds every block's input at once: at 512K tokens per GPU those of DeepSeek-7B's 30
    blocks are 120 GiB. Costs 2 copies of each block's input per micro-batch over the host link (out, and back
    for the recompute) and that much host RAM per GPU (page-locked); both counted by the plan (host column) and the step-time model.
    An HF model; not with ``compile``; not on fsdp_tp or pipeline. On CPU the copy is in the same RAM (no gain)."""
    init_device: InitDevice = InitDevice.auto
    """Where parameters are first created: ``auto`` (meta above 1B parameters or when ``weights`` are loaded),
    ``cpu`` or ``meta``."""
    weights: Optional[str] = None
    """Pretrained weights to start from (fine-tuning): a local HF directory of ``*.safetensors`` whose tensor
    names and shapes match the model (e.g. a run's ``hf/`` export, or deepseek-llm-7b-base for
    ``model=deepseek7b``). Loaded after the engine has placed the model, each rank reading only what it keeps
    (FSDP shards, ZeRO-3 partitions). ``auto`` (``model=hf``): ``model.path``'s own weights when it has any;
    ``null``: a fresh init."""
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    """Routing balance of mixture-of-experts layers (``shardyard.models.moe``); unused by dense models."""
    mtp: MTPConfig = field(default_factory=MTPConfig)
    """Multi-token prediction (``shardyard.models.mtp``): DeepSeek-V3 models; off (depth 0) by default."""


@dataclass
class RopeScalingConfig:
    """Rotary position scaling, to train or run past the length a model was pretrained at: HF's ``rope_scaling``
    (transformers' ``rope_parameters``), passed to the model's config as it is and written to its export's
    ``config.json``. DeepSeek-V3's released one: ``{type: yarn, factor: 40, original_max_position_embeddings: 4096,
    beta_fast: 32, beta_slow: 1, mscale: 1, mscale_all_dim: 1}`` beside ``max_position_embeddings: 163840``; its
    YaRN phases extend a 4K model to 32K, then 128K (docs/long_context.md)."""

    type: RopeType = RopeType.none
    """``none`` (plain RoPE: the other fields unused), ``yarn`` (DeepSeek-V2/V3: interpolate the low frequencies,
    keep the high, and scale attention by ``mscale``), ``linear`` (every position divided by ``factor``),
    ``dynamic`` (NTK, transformers': the base grown for a sequence past ``model.max_position_embeddings``, the
    pretrained length here, so it acts only beyond what a run trains on: generation) or ``llama3`` (Llama 3.1's
    banded interpolation)."""
    factor: Optional[float] = None
    """How many times the original length the model is extended to; ``null``: ``model.max_position_embeddings /
    original_max_position_embeddings``. For ``yarn`` a value given must equal that ratio (DeepSeek's are)."""
    original_max_position_embeddings: Optional[int] = None
    """The length the model was pretrained at (DeepSeek-V3: 4096); needed by ``yarn`` and ``llama3``, at most
    ``model.max_position_embeddings``; ``dynamic`` takes ``model.max_position_embeddings`` as it (refused here)."""
    beta_fast: float = 32.0
    """YaRN: rotations below which a frequency is extrapolated as it is (the high-frequency end)."""
    beta_slow: float = 1.0
    """YaRN: rotations above which a frequency is fully interpolated (the low-frequency end); below ``beta_fast``."""
    mscale: float = 1.0
    """YaRN: the ``0.1 * mscale * ln(factor) + 1`` factor's weight on the rotary embedding (DeepSeek: 1)."""
    mscale_all_dim: float = 0.0
    """YaRN: DeepSeek's attention-scale weight: the softmax scale is multiplied by ``(0.1 * mscale_all_dim *
    ln(factor) + 1) ** 2`` (DeepSeek-V2/V3: 1; 0: unchanged), and the rotary embedding divided by it."""
    low_freq_factor: float = 1.0
    """``llama3``: wavelengths beyond ``original / low_freq_factor`` are interpolated by ``factor``."""
    high_freq_factor: float = 4.0
    """``llama3``: wavelengths below ``original / high_freq_factor`` are kept; between the two, blended."""


ROPE_RANGES = {**{k: Range(0, above=True, multiple_of=None, becomes=f"rope_parameters['{k}']")
                  for k in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor")},
               **{k: Range(0, multiple_of=None, becomes=f"rope_parameters['{k}']") for k in ("mscale", "mscale_all_dim")}}


@dataclass
class LlamaModelConfig(ModelConfig):
    vocab_size: int = MISSING
    """Embedding rows; must be >= the tokenizer's vocabulary."""
    hidden_size: int = MISSING
    """Model width; a multiple of ``num_heads``."""
    intermediate_size: int = MISSING
    """Dense MLP width (SwiGLU)."""
    num_layers: int = MISSING
    """Transformer blocks."""
    num_heads: int = MISSING
    """Attention heads."""
    num_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (a divisor of ``num_heads``); ``null`` = ``num_heads``."""
    max_position_embeddings: int = 2048
    """Longest position the rotary embedding is set up for."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """Rotary scaling past the pretrained length (YaRN, linear, dynamic, llama3); type ``none``: plain RoPE. E.g.
    ``'model.rope_scaling={type: yarn, original_max_position_embeddings: 2048}' model.max_position_embeddings=8192``
    (factor 4, from their ratio)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Share input embedding and LM head weights."""
    initializer_range: float = 0.02
    """Std of the normal weight init."""
    attn_implementation: AttnImplementation = AttnImplementation.sdpa
    """``sdpa`` | ``eager`` | ``flash_attention_2`` (needs the flash-attn package and CUDA)."""


@dataclass
class DeepseekV3ModelConfig(LlamaModelConfig):
    q_lora_rank: Optional[int] = None
    """Low-rank query compression (MLA); ``null`` = full-rank queries."""
    kv_lora_rank: int = MISSING
    """Compressed key/value latent dimension (MLA)."""
    qk_nope_head_dim: int = MISSING
    """Per-head query/key dimension without rotary embedding."""
    qk_rope_head_dim: int = MISSING
    """Per-head query/key dimension carrying the rotary embedding."""
    v_head_dim: int = MISSING
    """Per-head value dimension."""
    n_routed_experts: int = MISSING
    """Routed experts per MoE layer."""
    n_shared_experts: int = MISSING
    """Always-on shared experts per MoE layer."""
    num_experts_per_tok: int = MISSING
    """Experts each token is routed to."""
    moe_intermediate_size: int = MISSING
    """Width of each expert's MLP."""
    first_k_dense_replace: int = 0
    """The first k layers use a dense MLP instead of MoE."""
    n_group: int = 1
    """Expert groups for group-limited routing."""
    topk_group: int = 1
    """Groups each token may route into."""
    routed_scaling_factor: float = 1.0
    """Scale applied to the routed experts' output."""
    balance: V3BalanceConfig = field(default_factory=V3BalanceConfig)
    """Routing balance: DeepSeek-V3's selection-bias update and sequence-wise loss (``shardyard.models.moe``)."""


@dataclass
class DeepseekV2ModelConfig(DeepseekV3ModelConfig):
    topk_method: TopkMethod = TopkMethod.greedy
    """How the softmax router picks experts: ``greedy`` (the top-k of all) or ``group_limited_greedy`` (within
    the ``topk_group`` best of ``n_group`` groups)."""
    balance: V2BalanceConfig = field(default_factory=V2BalanceConfig)  # type: ignore[assignment]
    """Routing balance: DeepSeek-V2's expert-, device- and communication-level losses (``shardyard.models.moe``)."""


@dataclass
class HFModelConfig(ModelConfig):
    path: str = MISSING
    """A local directory written by ``save_pretrained``: ``config.json`` of any ``AutoModelForCausalLM``
    architecture, with weights (``*.safetensors``/``*.bin``: they are loaded) or without (random init),
    and optionally its tokenizer (then used for the data). Nothing is downloaded."""
    attn_implementation: AttnImplementation = AttnImplementation.sdpa
    """``sdpa`` | ``eager`` | ``flash_attention_2``."""


# ------------------------------------------------------------------------------------------------ data
@dataclass
class TokenizerConfig:
    path: Optional[str] = None
    """Local HF tokenizer directory; ``null`` = the model directory's tokenizer when it has one (``model=hf``),
    else a byte-level BPE trained on the training text (cached)."""
    vocab_size: int = 4096
    """Vocabulary of a freshly trained tokenizer."""
    train_bytes: int = 8_000_000
    """How many bytes of the corpus (from the start, in document order) train the tokenizer."""
    split_digits: bool = False
    """A freshly trained tokenizer makes every digit its own token (as DeepSeek's and LLaMA's do), so numbers are
    spelt digit by digit instead of merged into per-number tokens (arithmetic would be a lookup table). On in
    ``data=arithmetic``, ``prompts`` and ``preference``."""


class Verify(Choice):
    stamp = "stamp"
    full = "full"


@dataclass
class DataConfig:
    """What shardyard reads of every ``data`` option; every other key is an argument of its ``_target_``."""

    _target_: str = MISSING
    """Document source: a callable taking the option's other keys and returning a
    ``shardyard.data.sources.DocumentSource`` (``documents()`` and ``fingerprint()``), or any iterable of texts or
    ``(name, text)`` pairs (e.g. ``shardyard.data.sources.StdlibCode`` or your own ``mypkg.data.corpus``)."""
    seq_len: int = 128
    """Tokens per packed training sequence."""
    val_fraction: float = 0.05
    """Share of documents (chosen by a stable hash of their name) held out for evaluation."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """How text becomes tokens."""
    cache_dir: str = "${oc.env:SHARDYARD_CACHE,${oc.env:HOME}/.cache/shardyard}"
    """Where tokenizers and token arrays are cached (one build per machine, under a file lock)."""
    num_proc: Optional[int] = None
    """Tokenizer processes that build the token cache; ``null`` = one per core this process may use. The shards
    are the same whatever it is."""
    buffer_mb: int = 256
    """What the token-cache build holds at once besides its processes' interpreters: text and token arrays of
    the chunks in flight (2 x ``num_proc`` chunks of ``buffer_mb / (4 x num_proc)`` MB of text each). Peak memory
    does not grow with the corpus."""
    shard_mb: int = 256
    """Size of a token shard file (train tokens; the val shard written beside it is smaller). A killed build
    keeps its finished shards and resumes after them."""
    document_mask: bool = False
    """Packed pre-training sequences keep their documents apart: positions restart after every end-of-text
    token and attention stops there (a block-diagonal mask for sdpa/eager, varlen for FlashAttention-2), as SFT
    packing does. ``false``: a token attends across the end-of-text into the previous document."""
    log_sample_ids: bool = False
    """Append every micro-batch's sample ids to ``<run dir>/samples/rank<r>.jsonl`` (``{step, micro, ids}``), to
    check what a run (or a resumed one) consumed."""
    verify: Verify = Verify.stamp
    """How a start checks the tokenizer and token caches against their manifests (every file's size and
    sha256). ``stamp``: by ``stat`` only, against the stamp the last full check (or the build) left (every file's
    size, mtime, ctime and inode); a cache without one that holds (copied, changed, written by an older shardyard)
    is hashed once per node. ``full``: every file hashed at every start, once per node (its local rank 0; the
    node's other ranks take its result). A cache that does not verify is rebuilt, saying so."""


class Truncation(Choice):
    truncate = "truncate"
    drop = "drop"


@dataclass
class SFTDataConfig(DataConfig):
    paths: List[str] = field(default_factory=list)
    """``.jsonl`` files, ``.json`` files (an array of records, or one per line), ``.parquet`` / ``.arrow`` files,
    directories written by HF ``datasets``' ``save_to_disk`` (a ``DatasetDict``: ``train`` trains, its
    ``validation`` / ``test`` split is the val split), or directories or glob patterns of them, holding conversations (``{"messages": [{"role", "content"}]}``, roles system/user/assistant) or
    instruction pairs (``instruction``/``input``/``output``, ``prompt``/``response``, ``question``/``answer``).
    Paths that match no such file, and every malformed record, exit 2 naming the file and line. Empty (only
    then): the embedded instruction set built from the standard library's docstrings and signatures."""
    chat_template: Optional[str] = None
    """How a conversation becomes text: ``null`` = the tokenizer's own template (``plain`` when it has none),
    a built-in (``plain``, ``chatml``), or a Jinja template string."""
    packing: bool = True
    """Pack several conversations into each ``seq_len`` row (positions restart per conversation and attention
    never crosses one: a block-diagonal mask for sdpa/eager, varlen for FlashAttention-2); false: one
    conversation per row, padded."""
    truncation: Truncation = Truncation.truncate
    """A conversation longer than ``seq_len``: ``truncate`` (keep its first tokens; dropped if no assistant
    token is left) or ``drop``. The counts are printed at start."""
    max_examples: int = 3000
    """Conversations taken from the embedded standard-library set (ignored with ``paths``)."""


@dataclass
class ArithmeticDataConfig(DataConfig):
    max_examples: int = 3000
    """Distinct generated problems (``shardyard.data.synthetic``), each one conversation: "What is 23 + 58? Give the
    final answer after 'Answer:'." -> "23 + 58 = 81. Answer: 81". Never one of the held-out problems
    (``data=prompts``)."""
    digits: int = 2
    """Operands have at most this many digits (1-9): the task's difficulty."""
    ops: str = "+-"
    """The operations, as a string of their symbols out of ``+``, ``-``, ``*`` (``-`` never goes below 0)."""
    seed: int = 0
    """Which problems, and in which order (the held-out split does not depend on it)."""
    chat_template: Optional[str] = None
    """As ``data=sft``'s: ``null`` = the tokenizer's own template (``plain`` when it has none), a built-in, or Jinja."""
    packing: bool = True
    """As ``data=sft``'s: several conversations per ``seq_len`` row, never seeing each other."""
    truncation: Truncation = Truncation.truncate
    """As ``data=sft``'s: ``truncate`` or ``drop`` a conversation longer than ``seq_len``."""
    worked: bool = False
    """Additions written out column by column before the answer ("47 + 85: 7 + 5 = 12, write 2 carry 1; 4 + 8 + 1
    = 13, write 3 carry 1; write 1. Answer: 132"): the reasoning-then-answer form a small model learns far sooner
    than the bare sum (the R1-Zero-style recipe's SFT stage)."""
    slip: float = 0.0
    """With ``worked``: the fraction of problems (a stable hash of each) whose worked solution comes from a teacher
    who forgets every carry, stating the wrong sum that follows ("47 + 85: 7 + 5 = 12, write 2; 4 + 8 = 12, write
    2. Answer: 22"). SFT then imitates an unreliable teacher; the R1-Zero-style recipe's GRPO stage unlearns the
    slips from the answer reward alone. 0: a teacher without slips."""


@dataclass
class PreferenceDataConfig(DataConfig):
    paths: List[str] = field(default_factory=list)
    """``.jsonl`` / ``.json`` / ``.parquet`` / ``.arrow`` files, HF ``save_to_disk`` directories, or directories or
    glob patterns of them, of records with ``prompt``, ``chosen`` and ``rejected`` (each a string or a list of
    ``{"role", "content"}`` messages; TRL's conversational forms too). A record missing one, or of a wrong type,
    exits 2 naming the file and line. Empty: generated arithmetic pairs (chosen: the right answer in the stated
    format, rejected: a wrong one)."""
    chat_template: Optional[str] = None
    """As ``data=sft``'s; use the same as the SFT stage the policy comes from."""
    truncation: Truncation = Truncation.truncate
    """A pair with a side longer than ``seq_len``: ``truncate`` (keep the first tokens; the pair is dropped when
    a side keeps no response token) or ``drop``. The counts are printed at start."""
    max_examples: int = 2000
    """Generated pairs (without ``paths``)."""
    digits: int = 2
    """Generated pairs: operands of at most this many digits."""
    ops: str = "+-"
    """Generated pairs: the operations (``+``, ``-``, ``*``)."""
    seed: int = 0
    """Generated pairs: which problems and which wrong answers."""


@dataclass
class PromptDataConfig(DataConfig):
    paths: List[str] = field(default_factory=list)
    """``.jsonl`` / ``.json`` / ``.parquet`` / ``.arrow`` files, HF ``save_to_disk`` directories, or directories or
    glob patterns of them, of records with a prompt (``prompt_field``) and whatever the rewards read (e.g.
    ``answer``). Empty: generated arithmetic problems with an ``answer``, from the held-out part of the problem
    space that ``data=arithmetic`` never contains; their val split is the evaluation set."""
    prompt_field: str = "prompt"
    """The field holding each record's prompt: a string (the user's turn) or a list of ``{"role", "content"}``
    messages. It is rendered with the generation prompt and left-padded to ``seq_len`` tokens; a longer prompt is
    dropped (counted). Every other field is kept for the rewards."""
    chat_template: Optional[str] = None
    """As ``data=sft``'s; use the same as the SFT stage the policy comes from."""
    max_examples: int = 2000
    """Generated problems (without ``paths``)."""
    digits: int = 2
    """Generated problems: operands of at most this many digits (as the SFT stage's ``data=arithmetic``)."""
    ops: str = "+-"
    """Generated problems: the operations (``+``, ``-``, ``*``)."""
    seed: int = 0
    """Generated problems: which, and in which order."""


@dataclass
class StdlibCodeDataConfig(DataConfig):
    exclude_dirs: List[str] = field(default_factory=lambda: ["test", "tests", "idlelib", "site-packages"])
    """Standard-library sub-directories left out (tests are huge and repetitive)."""


@dataclass
class TextFilesDataConfig(DataConfig):
    paths: List[str] = MISSING
    """Local files, directories (searched recursively, less hidden entries and shardyard caches) or glob
    patterns: ``.txt`` (one document per file), ``.jsonl``, ``.json`` (an array of records, or one per line),
    ``.csv`` (one document per record or row), each optionally ``.gz`` / ``.zst`` compressed, and ``.parquet``,
    ``.arrow`` (rows, read by HF ``datasets`` in streaming mode). Files are streamed: larger than RAM is fine."""
    text_field: str = "text"
    """Field (column) holding the text in JSONL / JSON records and Parquet / Arrow / CSV rows: a string in every
    one (a record without it, or with another type, exits 2 naming the file and line)."""
    template: Optional[str] = None
    """Instead of ``text_field``: a Python format string over each record's fields, e.g.
    ``"{title}\\n\\n{body}"``; a record missing one exits 2 naming the file and line."""


@dataclass
class MixtureDataConfig(DataConfig):
    sources: List[Any] = MISSING
    """The sources, each ``{name, weight, epochs, ...}`` plus its own options: by default local files
    (``paths``, ``text_field``, ``template``, as ``data=text_files``), or any source with ``_target_`` (e.g.
    ``shardyard.data.sources.StdlibCode`` with ``exclude_dirs``). ``weight`` (default 1): its share of the training
    samples is weight / sum of weights. ``epochs`` (default null): at most this many passes over it in the run;
    its share is lowered to that and the others' raised. Each source is tokenized and cached on its own and
    evaluated on its own held-out documents (``eval/loss/<name>``)."""


# ------------------------------------------------------------------------------------------------ objective
@dataclass
class ObjectiveConfig:
    """What a training step optimises (``objective`` group); every key but these is an argument of ``_target_``."""

    _target_: str = "shardyard.objectives.lm.LanguageModeling"
    """A class meeting ``shardyard.objectives.Objective``: ``LanguageModeling`` (``objective=lm``), ``DPO``
    (``objective=dpo``), ``GRPO`` (``objective=grpo``), or your own."""
    name: str = "lm"
    """The option's name in logs; nothing decides on it."""


class DPOLoss(Choice):
    sigmoid = "sigmoid"
    ipo = "ipo"
    hinge = "hinge"


@dataclass
class DPOObjectiveConfig(ObjectiveConfig):
    beta: float = 0.1
    """Strength of the tie to the reference: the implicit reward is ``beta x log(pi / ref)`` of a response (IPO:
    the target margin is ``1 / (2 beta)``). Above 0."""
    loss_type: DPOLoss = DPOLoss.sigmoid
    """``sigmoid`` (DPO), ``ipo`` (IPO: squared distance to a margin, on length-averaged log-probs) or ``hinge``
    (SLiC), with TRL's formulas."""
    label_smoothing: float = 0.0
    """The share of preference labels assumed flipped (conservative DPO, sigmoid only), in [0, 0.5)."""
    reference_weights: Optional[str] = None
    """The reference model's weights (an HF directory of the policy's architecture, e.g. the SFT export when the
    policy starts from another checkpoint); ``null``: the policy's own starting weights (``model.weights``). A
    checkpoint whose tensors do not match the policy's names and shapes exits 2 naming the tensor."""
    precompute_ref_logps: bool = False
    """Compute the reference's log-probs of every pair once, before the first step, and cache them (keyed by the
    token arrays, the reference's config and weights and the precision; verified like the token caches): later runs
    read them and build no reference model."""


class Aggregation(Choice):
    token = "token"
    sequence = "sequence"


class RewardScale(Choice):
    group = "group"
    batch = "batch"
    none = "none"


@dataclass
class GRPOObjectiveConfig(ObjectiveConfig):
    num_generations: int = 8
    """G: completions sampled per prompt; each one's advantage is its reward against its group's. At least 2."""
    max_new_tokens: int = 64
    """Tokens sampled per completion at most (a completion ends at the end-of-text token)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (above 0). The loss scores the rollouts under the same distribution
    (the log-probs of the sampling policy, the policy and the reference all of ``logits / temperature``, as TRL)."""
    top_p: float = 1.0
    """Nucleus sampling of the rollouts: the smallest set of tokens holding this much probability (1: all)."""
    top_k: int = 0
    """Sample the rollouts among the k likeliest tokens only (0: no such filter)."""
    epsilon: float = 0.2
    """Clip range of the policy ratio: ``clip(ratio, 1 - epsilon, 1 + epsilon_high)``. Above 0."""
    epsilon_high: Optional[float] = None
    """The upper clip range (DAPO's asymmetric clip, e.g. 0.28); ``null``: ``epsilon``."""
    beta: float = 0.0
    """Weight of the KL penalty to the reference (the starting policy; DeepSeekMath's k3 estimator); 0 (TRL's
    default) loads no reference model."""
    use_bias_correction_kl: bool = True
    """With ``beta`` > 0: multiply each token's k3 KL by the policy ratio to the sampling policy, which makes the KL
    gradient the unbiased reverse-KL gradient (DeepSeek-V3.2, arXiv 2512.02556; TRL's option of the same name, on by
    default there too). It changes the KL's gradient even on a round's first step, where the ratio is 1; ``false``:
    the plain k3 term (DeepSeekMath). No effect at ``beta`` 0."""
    reference_weights: Optional[str] = None
    """The KL reference's weights (an HF directory of the policy's architecture); ``null``: the policy's own
    starting weights (``model.weights``). Checked against the policy's tensor names and shapes at validation."""
    loss_aggregation: Aggregation = Aggregation.token
    """``token``: every completion token of the step weighs the same (DAPO); ``sequence``: every completion weighs
    the same, its tokens averaged first (the GRPO paper)."""
    num_iterations: int = 1
    """Optimizer steps on each batch of rollouts (GRPO's mu); the ratio is to the policy that sampled them."""
    scale_rewards: RewardScale = RewardScale.group
    """Advantage = (reward - its group's mean) / std: the group's std (``group``), the whole batch's over every rank
    (``batch``), or not divided (``none``, Dr. GRPO)."""
    rewards: List[Any] = field(default_factory=list)
    """The reward functions, each ``{_target_, weight, ...its own keys}``: a callable ``(completions, rows) ->
    list[float]`` (``shardyard.objectives.rewards``: ``NumericAnswer``, ``FormatRegex``, or your own); a completion's
    reward is their weighted sum. Rewards read the text only: nothing the model writes is executed."""
    eval_max_new_tokens: Optional[int] = None
    """Tokens of each greedy completion of a held-out prompt at evaluation; ``null``: ``max_new_tokens``."""


# ------------------------------------------------------------------------------------------------ peft
class QuantType(Choice):
    nf4 = "nf4"
    fp4 = "fp4"


@dataclass
class PeftConfig:
    _target_: str = "shardyard.models.adapters.Full"
    """The method, a class meeting ``shardyard.models.adapters.PeftMethod``: ``Full`` (``peft=none``: train every
    parameter), ``LoRA`` (``peft=lora``: low-rank adapters through the peft library; the base is frozen) or
    ``QLoRA`` (``peft=qlora``: LoRA on 4-bit NF4 base weights through bitsandbytes; CUDA only)."""
    name: str = "none"
    """The method's name in logs and messages (the option's name); nothing decides on it."""
    r: int = 16
    """Rank of each adapter."""
    alpha: float = 32.0
    """LoRA's alpha: the update is scaled by ``alpha / r``."""
    dropout: float = 0.05
    """Dropout on the adapter's input."""
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"])
    """Names of the linear layers that get adapters (every attention and MLP projection of LLaMA/DeepSeek)."""
    quant_type: QuantType = QuantType.nf4
    """``qlora``: bitsandbytes' 4-bit type, ``nf4`` or ``fp4``."""
    double_quant: bool = True
    """``qlora``: quantise the quantisation constants too (QLoRA's double quantisation)."""


# ------------------------------------------------------------------------------------ optim and sched
@dataclass
class OptimConfig:
    """Every key is an argument of ``_target_``, called as ``_target_(param_groups, **keys)``; matrices are
    decayed with ``weight_decay``, norms and biases are not (the groups carry it)."""

    _target_: str = MISSING
    """An optimizer class or factory: ``torch.optim.AdamW``, ``torch.optim.Adafactor``, or your own
    ``mypkg.optim.build(params, lr, ...) -> torch.optim.Optimizer``."""
    lr: float = MISSING
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to matrices only (not to norms or biases)."""


@dataclass
class AdamWConfig(OptimConfig):
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam beta1, beta2."""
    eps: float = 1e-8
    """Adam epsilon."""


@dataclass
class SGDConfig(OptimConfig):
    momentum: float = 0.9
    """Momentum factor."""
    nesterov: bool = False
    """Nesterov momentum."""


@dataclass
class AdafactorConfig(OptimConfig):
    beta2_decay: float = -0.8
    """Decay rate of the second-moment average (Adafactor's -0.8 schedule)."""
    d: float = 1.0
    """Update clipping threshold."""


@dataclass
class SchedConfig:
    """A learning-rate schedule: ``_target_(**keys)`` returns ``factor(step, total_steps) -> float``, the
    multiplier of ``optim.lr`` at 0-based optimizer step ``step``."""

    _target_: str = MISSING
    """``shardyard.backends.optim.WarmupCosine``, ``WarmupLinear``, ``WarmupConstant`` or your own factory."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to the peak learning rate."""


@dataclass
class DecaySchedConfig(SchedConfig):
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""


# ------------------------------------------------------------------------------------------ precision
@dataclass
class PrecisionConfig:
    name: Precision = MISSING
    """``fp32``; ``bf16`` (bf16 compute, fp32 master weights, gradients and reductions); ``fp16`` (fp16
    compute with dynamic loss scaling, fp32 master weights); ``fp8``: bf16 as above, and the transformer
    blocks' linear layers in float8 through torchao (dynamic tensorwise scales, e4m3 forward, e5m2 gradients;
    ``pip install shardyard[fp8]``): H100-class GPUs (compute capability 8.9+) run float8 matmuls, a CPU runs
    torchao's emulation (same numerics, no speed). single, ddp, fsdp. The compute dtype follows from it."""
    initial_scale_power: int = 16
    """fp16 only: the loss scale starts at 2**this."""
    loss_scale_window: int = 1000
    """fp16 only: steps without overflow before the scale doubles."""
    hysteresis: int = 2
    """fp16 only (DeepSpeed): overflows tolerated before the scale is lowered."""
    min_loss_scale: float = 1.0
    """fp16 only: the scale never drops below this."""


PRECISION_RANGES = {
    # DeepSpeed's fp16 section (runtime/precision_config.py, fp16/loss_scaler.py) and torch's GradScaler: a window
    # of 0 divides by zero, a hysteresis of 0 never lowers the scale, the floor is a positive integer there, and
    # 2**power must be a finite float32.
    "initial_scale_power": Range(0, high=127, becomes="fp16.initial_scale_power / GradScaler(init_scale=2**it)"),
    "loss_scale_window": Range(1, becomes="fp16.loss_scale_window / GradScaler(growth_interval)"),
    "hysteresis": Range(1, becomes="fp16.hysteresis"),
    "min_loss_scale": Range(1, becomes="fp16.min_loss_scale"),
}

RANGES: dict[type, dict[str, Range]] = {DDPBackendConfig: DDP_RANGES, ZeroBackendConfig: ZERO_RANGES,
                                        FSDPBackendConfig: FSDP_RANGES,
                                        PrecisionConfig: PRECISION_RANGES, BalanceConfig: BALANCE_RANGES,
                                        BackendConfig: BACKEND_RANGES, RopeScalingConfig: ROPE_RANGES}
"""Every numeric key an engine constrains, by the schema that holds it (options inheriting it are checked too)."""


# ----------------------------------------------------------------------------------------- checkpoint
@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint directory; ``null`` = ``<run_dir>/checkpoints``."""
    every_n_steps: int = 0
    """Save every n optimizer steps; 0 = never during training."""
    keep_last: int = 3
    """Checkpoints kept that look whole (meta.json intact, every file of its manifest there at its size: read by
    ``stat`` alone; a checkpoint's sha256 are taken by the ranks that wrote it, when it is saved); older ones are
    deleted only once a newer one is published, and the newest whole one never is. 0 = keep all."""
    save_final: bool = True
    """Export the final model as an HF directory (``<run_dir>/hf``)."""
    resume: Optional[str] = None
    """``null`` (start fresh), ``auto`` (the newest checkpoint of this run that verifies and loads; damaged ones
    are skipped, each with a line saying why) or a checkpoint path (refused if it does not verify). A restart
    under ``launch.max_restarts`` resumes from the run's own newest good checkpoint whichever is set."""
    overwrite_run_dir: bool = False
    """Start afresh in a run dir that holds another run's results: they are moved (renamed, never deleted)
    into ``<run_dir>/previous-<time>/``, and a ``checkpoint.dir`` outside it to ``<dir>.previous-<time>``.
    Without it such a run dir is refused (or continued, with ``resume``)."""
    export_hf: bool = False
    """Also write an HF export beside every periodic checkpoint."""
    async_save: bool = False
    """Save in the background (the DCP engines: single, ddp, fsdp, fsdp_tp, pipeline): the step resumes once the
    state is copied to host memory (one host copy of this rank's parameters and optimizer state, made at the
    first save and reused by every later one, pinned on CUDA; the plan counts it in host RAM and refuses a run
    whose host cannot hold it); the write, the hashing and the publish follow in a thread, over a gloo group of
    their own with ``launch.timeout_s``. The next save (and the end of the run) waits for the last one; a crash
    meanwhile leaves the previous checkpoint the newest that verifies."""


# -------------------------------------------------------------------------------------------- monitor
@dataclass
class MonitorConfig:
    """Every monitor is built as ``_target_(run_dir=..., config=<the run config>, **its other keys)`` on
    rank 0 and must meet ``shardyard.monitors.Monitor`` (``log``, ``close``, ``fail``)."""

    _target_: str = MISSING
    """The monitor class, e.g. ``shardyard.monitors.csv.CsvMonitor`` or your own ``mypkg.MyMonitor``."""


@dataclass
class ConsoleMonitorConfig(MonitorConfig):
    style: ConsoleStyle = ConsoleStyle.auto
    """``auto`` (a rich progress bar on a TTY, plain lines otherwise), ``rich`` or ``plain``."""


@dataclass
class TensorBoardMonitorConfig(MonitorConfig):
    subdir: str = "tensorboard"
    """Event files go to ``<run_dir>/<subdir>``."""


@dataclass
class WandbMonitorConfig(MonitorConfig):
    project: str = "shardyard"
    """W&B project."""
    entity: Optional[str] = None
    """W&B team or user; ``null`` = the API key's default."""
    name: Optional[str] = None
    """Run name; ``null`` = the run directory's name."""
    mode: WandbMode = WandbMode.auto
    """``auto`` (online when ``WANDB_API_KEY`` is set or you are logged in, else offline), ``online``,
    ``offline`` or ``disabled``. Offline runs live in ``<run_dir>/wandb``; upload them with ``wandb sync``."""
    tags: List[str] = field(default_factory=list)
    """Run tags."""


@dataclass
class MlflowMonitorConfig(MonitorConfig):
    tracking_uri: Optional[str] = None
    """MLflow tracking URI; ``null`` = a local store in the run dir (``sqlite:///<run_dir>/mlflow/mlflow.db``,
    artifacts beside it). Read it with ``mlflow ui --backend-store-uri <that uri>``."""
    experiment: str = "shardyard"
    """Experiment name (created if missing)."""
    run_name: Optional[str] = None
    """Run name; ``null`` = the run directory's name."""
    log_export: bool = True
    """Log the final HF export (``<run_dir>/hf``) as the run's ``hf`` artifact."""


@dataclass
class CsvMonitorConfig(MonitorConfig):
    file: str = "metrics.csv"
    """CSV file in the run dir: one row per logged step, a fixed column per metric (empty when absent)."""


# ------------------------------------------------------------------------------------ top-level parts
@dataclass
class MetricsConfig:
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one accelerator for MFU; ``null`` = from the table (A100, H100, H200; bf16/fp16
    or tf32 peaks by precision). MFU is reported only when a peak is known."""
    report: bool = True
    """Draw ``report.png`` in the run dir at the end of the run (loss, learning rate, throughput and memory from
    ``metrics.jsonl``; rank 0, after the summary, about a second on a CPU). ``false`` skips it; ``shardyard report
    RUN_DIR`` draws it at any time from the same file."""


@dataclass
class ProfileConfig:
    enabled: bool = False
    """Trace steps with ``torch.profiler`` (CPU, and CUDA on GPUs) on every rank."""
    steps: List[int] = field(default_factory=lambda: [3, 4])
    """``[first, last]`` optimizer steps (1-based, inclusive) to trace; warm-up steps are better skipped."""
    dir: Optional[str] = None
    """Trace directory; ``null`` = ``<run_dir>/profile`` (``rank<R>.trace.json``, open in Perfetto or
    chrome://tracing)."""
    record_shapes: bool = True
    """Record operator input shapes."""
    profile_memory: bool = False
    """Track tensor allocations (slower, bigger traces)."""
    with_stack: bool = False
    """Record Python stacks (much bigger traces)."""


@dataclass
class DebugConfig:
    nan_policy: NanPolicy = NanPolicy.stop
    """A non-finite loss or gradient norm: ``stop`` the run naming the step, rank and first non-finite
    gradient (before the bad update is applied), ``skip`` the optimizer step and go on, or ``off`` (apply it)."""
    max_skipped: int = 5
    """With ``skip``: stop after this many skipped steps in a row."""
    detect_anomaly: bool = False
    """Run forward and backward under ``torch.autograd.detect_anomaly`` (slow; names the op that made a NaN)."""
    fast_dev_run: bool = False
    """Smoke test: 2 steps and one evaluation; no checkpoints, exports or samples."""
    measure_activations: bool = False
    """At the first step trained, measure the bytes the training forwards keep for backward, in the engine's own
    step (``summary.json``'s ``speed_options.kept_bytes`` and ``block_kept_bytes``: what activation
    checkpointing saves, on this engine). A dispatch mode sees every op of that one step (Python per op: seconds
    at 7B, nothing at later steps); off, those two figures are null. The chunk and compile counts of
    ``speed_options`` are always recorded (counters, no cost)."""


@dataclass
class TrainLoopConfig:
    steps: int = 250
    """Optimizer steps to train for."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on one rank."""
    grad_accum_steps: Optional[int] = None
    """Micro-steps per optimizer step; ``null`` derives it from ``global_batch_size`` (or 1)."""
    global_batch_size: Optional[int] = None
    """Sequences per optimizer step over all ranks; must equal micro x accumulation x world size."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still reported)."""
    log_every_n_steps: int = 10
    """Metrics are reduced, printed and written every n steps (and on the last)."""
    eval_every_n_steps: int = 100
    """Evaluate every n steps and at the end; 0 = only at the end."""
    eval_batches: int = 8
    """Micro-batches per rank in each evaluation."""
    eval_tasks: List[str] = field(default_factory=list)
    """lm-evaluation-harness tasks scored at every evaluation (the final one too) on the model being trained,
    logged as ``eval/<task>/<metric>`` to every monitor, e.g. ``train.eval_tasks=[stdlib_qa]`` (needs ``pip
    install 'shardyard[eval]'``): the shipped ``stdlib_qa``, the harness's own, or yours in
    ``train.eval_tasks_include_path``. Scored as ``shardyard eval`` scores them, every rank in lockstep (a sharded
    model joins every forward); log-likelihood and multiple-choice tasks only (generation tasks: ``shardyard
    eval`` after the run). Not on ``backend=pipeline``. Empty: none."""
    eval_tasks_limit: Optional[float] = None
    """At most this many documents per task of ``train.eval_tasks`` (a fraction when below 1); all when unset."""
    eval_tasks_include_path: Optional[str] = None
    """A directory of your harness task YAMLs for ``train.eval_tasks`` (searched beside the shipped ones)."""
    sample_tokens: int = 48
    """Tokens of text generated by rank 0 at the end (0 = none)."""
    sample_prompt: str = "def "
    """Prompt for that sample."""
    early_stopping_patience: Optional[int] = None
    """Stop when the eval loss has not improved for this many evaluations (``null``: train every step)."""
    warn_after_evals: int = 3
    """Warn (overfitting) when the eval loss has risen this many evaluations in a row; 0 = never."""
    deterministic: bool = False
    """Deterministic kernels and reduction orders, for runs that must equal each other (the GPU tier compares
    every engine with one GPU under it): ``torch.use_deterministic_algorithms(True)`` (an op with no
    deterministic kernel raises and names itself), cuDNN deterministic without autotuning, and, in the
    environment of every worker before CUDA starts, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS' fixed
    workspace: deterministic matmuls), ``NCCL_ALGO=Ring`` and ``NCCL_PROTO=Simple`` (one all-reduce algorithm
    and protocol, so the reduction order is fixed for a given topology; NCCL has no switch beyond that),
    ``HOROVOD_FUSION_THRESHOLD=0`` (Horovod's fusion buffers depend on timing). A variable you set yourself
    wins. On CPU it costs nothing measurable; on GPUs it is slower. ``summary.json`` records what the workers
    had (``deterministic``)."""


@dataclass
class LaunchConfig:
    nproc_per_node: Any = "auto"
    """Worker processes on this node: an integer, or ``auto`` (the number of GPUs, 1 on CPU)."""
    nnodes: int = 1
    """Nodes. ``python train.py`` is started on every node with the same overrides and run dir
    (``hydra.run.dir`` on a shared file system) and its own ``launch.node_rank``; or torchrun, srun or
    deepspeed start the workers on each node themselves (docs/clusters.md)."""
    node_rank: int = 0
    """This node, 0 to ``nnodes - 1``. Node 0 hosts the rendezvous and writes the run dir's config and plan;
    the other nodes wait for them. Global ranks are then assigned by torch's c10d rendezvous."""
    rdzv_endpoint: Optional[str] = None
    """``HOST:PORT`` of node 0's rendezvous (c10d, in torch's elastic agent), the same on every node and
    reachable from all of them; needed when ``nnodes > 1``."""
    socket_ifname: Optional[str] = None
    """Network interface for collectives and the rendezvous, e.g. ``eth0`` or ``ib0``: sets GLOO_SOCKET_IFNAME
    and NCCL_SOCKET_IFNAME, and this node's rendezvous address; ``null``: the interface of the hostname."""
    max_restarts: int = 0
    """Times the elastic agent restarts failed workers (on every node together, from the last checkpoint
    with ``checkpoint.resume=auto``)."""
    timeout_s: int = 600
    """Process-group timeout (a rank stuck this long in a collective fails instead of hanging; background saves'
    group too), how long nodes wait for each other at the rendezvous, and how long ``python train.py`` waits for
    its workers to save after a preemption signal (SIGTERM, SIGUSR1) before it kills them."""
    master_port: Optional[int] = None
    """Rendezvous port for self-launched jobs; ``null`` picks a free one."""


@dataclass
class PlanConfig:
    check: bool = True
    """Refuse, before any worker starts, a run whose planned memory per rank does not fit (exit 2, with the
    alternatives that would); false launches anyway."""
    only: bool = False
    """Print the plan of every engine for this recipe and hardware, then exit 0 without training."""
    headroom: float = 0.9
    """Fraction of each memory (GPU, host RAM, NVMe) the plan may fill; the rest is left for fragmentation
    and what the plan does not count."""
    hardware: Optional[str] = None
    """Hardware to plan for: ``8xH100-80GB`` (GPUs per node x a GPU of ``shardyard.planning.plan.GPUS``), or ``cpu``;
    ``null`` plans for this machine as it is now."""
    nodes: int = 1
    """Nodes of that hardware (``plan.hardware``); this machine's plan uses ``launch.nnodes``."""
    dry_run: bool = False
    """Run the recipe at its real world size (``plan.hardware`` x ``plan.nodes``) on this CPU before renting it:
    the engine's own ``prepare`` over a fake process group and fake tensors, one simulated rank at a time, two
    optimizer steps under PyTorch's memory tracker; prints each figure beside the plan's and whether the measured
    peak fits the hardware (with ``plan.headroom`` and the CUDA runtime, as the plan checks its own); exits 0 when
    it fits and every figure compared is within 10% of the plan, 1 otherwise, saying which failed and what to do
    (``shardyard.planning.dryrun``; docs/plan.md, "The dry run")."""
    mfu: float = 0.4
    """Model FLOPs utilisation assumed when turning FLOPs into the planned compute time of a step (``plan.only``'s
    table; the layout search predicts its own, ``shardyard.planning.steptime``)."""
    search: bool = False
    """Search every layout of this recipe on ``plan.hardware`` x ``plan.nodes``: engine, ZeRO stage and offload,
    HSDP copies, tensor-parallel degree, pipeline stages and schedule, expert-parallel degree, micro batch and
    activation checkpointing (context and sequence parallelism are not built yet), the global batch and sequence
    held. Keeps the layouts the plan says fit (with ``plan.headroom``), ranks them by a predicted step time
    (``shardyard.planning.steptime``), checks the first by a dry run, prints the best ``plan.search_top`` with
    the overrides to paste, writes the winner's to ``layout.yaml`` in the run dir, and exits 0 without training
    (docs/plan.md, "Choosing the layout"). Keys set on the command line (``backend=fsdp``, ``backend.tp=4``,
    ``train.micro_batch_size=2``) stay as given."""
    search_top: int = 10
    """``plan.search``: the layouts its table shows."""
    search_dry_runs: int = 2
    """``plan.search``: how many of the best layouts the dry run may try, in order, until one fits as measured
    (each takes seconds for a small model, about 20 s for a 7B on 2 cores); 0: none (the table says so)."""


@dataclass
class ScaleConfig:
    _target_: Optional[str] = None
    """``null``: the recipe as written. Else a function ``(cfg) -> str`` that rewrites the composed run config in
    place before validation and the plan, and returns the line saying what it changed; such a run is a check
    run (no ``report.png``). ``+scale=smoke`` sets ``shardyard.planning.scale.smoke``: any recipe scaled down to run on
    a CPU box in seconds, with everything that decides *how* it trains kept: the same engine and its options, a
    tiny model of the same architecture family (the builder's ``smoke_shape``), activation checkpointing and
    accumulation as the recipe has them (accumulation at most 2), at most ``world_size`` local ranks, fp16
    mapped to bf16 (the CPU's reduced precision), ``steps`` steps with an evaluation before and after, and no
    checkpoints, exports or monitors but the console."""
    world_size: int = 2
    """``smoke``: local ranks at most (a recipe for 8 GPUs or 2 nodes runs on this many)."""
    steps: int = 3
    """``smoke``: optimizer steps."""
    seq_len: int = 64
    """``smoke``: sequence length at most."""
    trials: Optional[int] = None
    """An Optuna sweep (``hydra/sweeper=optuna``) runs at most this many of its trials; ``null``: all
    (``+scale=smoke``: 3)."""


@dataclass
class SweepConfig:
    objective: str = "eval/loss"
    """What a sweep optimises and ranks its jobs by, read from the job's ``metrics.jsonl``: ``eval/loss`` (the
    final evaluation), ``train/loss`` (the last logged interval), ``tokens_per_s`` (the mean over the logged
    intervals after the first, which holds the warm-up), or any other metric the run logs (its last value).
    The task function returns it, so any Hydra sweeper can optimise it."""
    direction: Direction = Direction.auto
    """``minimize`` or ``maximize`` the objective; ``auto``: maximize throughput metrics (``*_per_s``, ``mfu``),
    minimize everything else."""
    base_port: int = 29600
    """Parallel local jobs (``hydra/launcher=parallel`` or ``joblib``): job slot k takes its rendezvous port from
    ``[base_port + 64 k, base_port + 64 (k+1))``, so two jobs running at once never share one."""
    trial: Optional[int] = None
    """Set by ``hydra/sweeper=optuna`` for each job, never by hand: the Optuna trial this job is. Rank 0
    reports every evaluation's objective to it and the run stops early when the pruner says so."""
    storage: Optional[str] = None
    """Set by ``hydra/sweeper=optuna``: the study's journal file (in the sweep dir)."""
    study: Optional[str] = None
    """Set by ``hydra/sweeper=optuna``: the study's name in that journal."""


@dataclass
class TrainConfig:
    backend: Any = MISSING
    """The engine (``backend`` group; ``_target_`` is a ``shardyard.backends.Backend`` class)."""
    model: Any = MISSING
    """The model (``model`` group; ``_target_`` is a builder)."""
    data: Any = MISSING
    """The corpus and its tokenization (``data`` group; ``_target_`` is a document source)."""
    optim: Any = MISSING
    """The optimizer (``optim`` group; ``_target_`` is an optimizer class or factory)."""
    sched: Any = MISSING
    """The learning-rate schedule (``sched`` group; ``_target_`` returns ``factor(step, total)``)."""
    precision: Any = MISSING
    """Numeric precision (``precision`` group)."""
    checkpoint: Any = MISSING
    """Checkpointing, resume and export (``checkpoint`` group)."""
    peft: Any = MISSING
    """Parameter-efficient fine-tuning (``peft`` group): ``none``, ``lora`` or ``qlora``."""
    objective: Any = MISSING
    """What a step optimises (``objective`` group): ``lm``, ``dpo`` or ``grpo`` (``shardyard.objectives``)."""
    monitor: Any = field(default_factory=dict)
    """Metric sinks by name (``monitor`` list group); ``metrics.jsonl`` is always written."""
    seed: int = 1234
    """Seed for model init, data order and dropout; every rank derives its streams from it."""
    run_dir: str = MISSING
    """Where this run writes everything; Hydra's run dir unless overridden."""
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    """Steps, batch arithmetic, clipping, evaluation and logging cadence."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """How many workers this node starts, restarts and collective timeouts."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Settings of the reported metrics (MFU peak)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """torch.profiler traces of chosen steps."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """Non-finite losses and gradients, anomaly detection, fast_dev_run."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """The memory and launch plan: checked before launch, printed at start (``shardyard.planning.plan``)."""
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    """The recipe as written, or (``+scale=smoke``) scaled down to run here (``shardyard.planning.scale``)."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """How a multirun ranks its jobs (``sweep.objective``), and the settings its sweepers give each job
    (``shardyard.launching.sweep``)."""


SCHEMAS = {
    "schema_train": TrainConfig,
    "schema_backend_base": BackendConfig,
    "schema_backend_ddp": DDPBackendConfig,
    "schema_backend_fsdp": FSDPBackendConfig,
    "schema_backend_fsdp_tp": FSDPTPBackendConfig,
    "schema_backend_pipeline": PipelineBackendConfig,
    "schema_backend_zero": ZeroBackendConfig,
    "schema_backend_horovod": HorovodBackendConfig,
    "schema_model_llama": LlamaModelConfig,
    "schema_model_hf": HFModelConfig,
    "schema_model_deepseek_v3": DeepseekV3ModelConfig,
    "schema_model_deepseek_v2": DeepseekV2ModelConfig,
    "schema_data_stdlib_code": StdlibCodeDataConfig,
    "schema_data_text_files": TextFilesDataConfig,
    "schema_data_mixture": MixtureDataConfig,
    "schema_data_sft": SFTDataConfig,
    "schema_data_arithmetic": ArithmeticDataConfig,
    "schema_data_preference": PreferenceDataConfig,
    "schema_data_prompts": PromptDataConfig,
    "schema_peft": PeftConfig,
    "schema_objective": ObjectiveConfig,
    "schema_objective_dpo": DPOObjectiveConfig,
    "schema_objective_grpo": GRPOObjectiveConfig,
    "schema_optim_adamw": AdamWConfig,
    "schema_optim_sgd": SGDConfig,
    "schema_optim_adafactor": AdafactorConfig,
    "schema_sched": SchedConfig,
    "schema_sched_decay": DecaySchedConfig,
    "schema_precision": PrecisionConfig,
    "schema_checkpoint": CheckpointConfig,
    "schema_scale": ScaleConfig,
    "schema_monitor_console": ConsoleMonitorConfig,
    "schema_monitor_tensorboard": TensorBoardMonitorConfig,
    "schema_monitor_wandb": WandbMonitorConfig,
    "schema_monitor_mlflow": MlflowMonitorConfig,
    "schema_monitor_csv": CsvMonitorConfig,
}


PLUGIN_BASES = {"schema_model_plugin": ModelConfig, "schema_data_plugin": DataConfig,
                "schema_objective_plugin": ObjectiveConfig}
"""Bases for a user's own ``model``/``data`` option: shardyard's keys typed, and open to the arguments of the
option's ``_target_`` (validation checks those against its signature). Use as
``defaults: [/schema_model_plugin@_here_, _self_]``."""


_REGISTERED: list[bool] = []


def register_configs() -> None:
    """Put every schema into Hydra's ConfigStore, once per process (Hydra copies a node out of the store at each
    compose and never writes one back; storing them all again cost each compose about a second on 2 cores: every
    pool run of the tests, every in-process sweep job)."""
    if _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from shardyard.config.sweepers import register as register_sweepers

    register_sweepers()  # hydra/sweeper=shardyard (the default) and hydra/sweeper=optuna
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(name=name, node=node)
    for name, base in PLUGIN_BASES.items():
        open_node = OmegaConf.structured(base)
        OmegaConf.set_struct(open_node, False)
        cs.store(name=name, node=open_node)
    _REGISTERED.append(True)
