"""DeepSeek-V3's multi-token prediction (MTP; arXiv 2412.19437, section 2.2): ``model.mtp``.

Depth k (1..D) predicts token i+k+1 at position i:

    h'_k   = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_{k-1})])
    h_k    = shared_head.norm(one decoder block (dense or MoE as the model's layer L would be) on h'_k)
    logits = lm_head(h_k)

h_0 is the main model's output after its final norm (``model.norm``), and h_k (k >= 1) depth k's after its own
(``shared_head.norm``): each depth reads the previous stage's output after that stage's final norm, as
Megatron-Core does (``MultiTokenPredictionLayer`` returns its ``final_layernorm``'s output, which is both what the
output layer reads and the next depth's ``hidden_states``; Megatron's converters map that ``final_layernorm`` to
``shared_head.norm``). So a depth >= 2 model trained by Megatron loads here and means the same. DeepSeek-V3's
official checkpoint has one depth, which reads h_0 either way (docs/deepseek_v3.md "MTP chaining").

The embedding and the output head are the main model's (shared, as the paper says); each depth has its own norms,
projection, block and final norm. The modules live where DeepSeek's official checkpoints keep them: depth k is
``model.layers.{num_hidden_layers + k - 1}`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and a whole
decoder layer), which transformers' own forward never runs (it iterates ``layers[:num_hidden_layers]``). So the
official layout loads and exports by name, FSDP shards the depth like any block, and activation checkpointing,
compile, expert parallelism and the MoE balance treat it as one more block.

The training loss is ``L_main + weight / D * sum_k L_k`` with each ``L_k`` the mean over its own label tokens
(token-weighted over micro-batches and ranks like the main loss: ``shardyard.training.loop``); ``weight`` follows
``model.mtp.weight`` / ``final_weight`` (the paper: 0.3, then 0.1). The model's forward computes the depths only
inside ``training_targets`` (the training loss): evaluation, sampling and the export see the plain causal LM.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from shardyard.core.errors import UserError

FAMILIES = ("DeepseekV3ForCausalLM",)
"""The model classes MTP is built for (DeepSeek-V3's layout and block)."""


def depth(model: Any) -> int:
    """The MTP depths attached to ``model`` (0: none)."""
    return int(getattr(model, "shardyard_mtp_depth", 0))


def _hf(model: Any) -> Any:
    """The transformers model itself, also inside peft's ``PeftModel`` (whose ``.model`` is the causal LM, not its
    inner decoder)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def layers(model: Any) -> list[torch.nn.Module]:
    """The MTP depths' modules, depth 1 first (``model.layers[num_hidden_layers:]``)."""
    d = depth(model)
    inner = _hf(model).model
    return list(inner.layers[len(inner.layers) - d:]) if d else []


def _own_stream() -> Any:
    """A random stream of the depths' own: every generator ``manual_seed`` reseeds (CPU, and CUDA's once it is
    initialised) restored on leaving."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else [])


def check(mtp: DictConfig, family: str) -> None:
    """``model.mtp``'s values, and that the model family has MTP (``family``: the built model's class name)."""
    if mtp.depth < 0:
        raise UserError("model.mtp.depth", mtp.depth, "It counts the extra tokens predicted ahead, so it cannot be "
                        "negative.", "Use model.mtp.depth=0 (off) or 1 (DeepSeek-V3's).")
    if mtp.weight < 0:
        raise UserError("model.mtp.weight", mtp.weight, "It weighs the MTP losses into the training loss, so it "
                        "cannot be negative.", "Use model.mtp.weight>=0 (DeepSeek-V3: 0.3, then 0.1 as "
                        "model.mtp.final_weight); model.mtp.depth=0 turns MTP off.")
    if mtp.get("final_weight") is not None and mtp.final_weight < 0:
        raise UserError("model.mtp.final_weight", mtp.final_weight, "It must be at least 0.",
                        "Use model.mtp.final_weight=0.1 (the paper's) or null (model.mtp.weight throughout).")
    if mtp.get("final_weight") is not None and (mtp.get("final_weight_from_step") is None
                                                or mtp.final_weight_from_step < 1):
        raise UserError("model.mtp.final_weight_from_step", mtp.get("final_weight_from_step"),
                        "model.mtp.final_weight needs the training step (from 1) from which it replaces "
                        "model.mtp.weight.",
                        "Set model.mtp.final_weight_from_step to a step >= 1, or model.mtp.final_weight=null.")
    if mtp.depth > 0 and family not in FAMILIES:
        raise UserError("model.mtp.depth", mtp.depth, f"Multi-token prediction is built for DeepSeek-V3's layout "
                        f"({', '.join(FAMILIES)}), and this model is a {family}.",
                        "Use model.mtp.depth=0 with it, or a DeepSeek-V3 model (model=deepseek_moe_tiny, deepseek_v3, "
                        "or model=hf with a DeepSeek-V3 directory).")


def check_seq_len(depth: int, seq_len: int) -> None:
    """Depth k predicts token i+k+1 at position i, so a row of ``seq_len`` inputs gives it ``seq_len - k`` targets:
    every depth needs ``depth <= seq_len - 1`` (a deeper one would have none, and its rolled row would wrap)."""
    if depth >= seq_len:
        raise UserError("model.mtp.depth", depth, f"Depth k predicts the token k+1 ahead, so a row of data.seq_len="
                        f"{seq_len} tokens gives it {seq_len} - k targets: depth {depth} leaves no target to train on "
                        f"(depths must be at most data.seq_len - 1 = {seq_len - 1}).",
                        f"Use model.mtp.depth<={seq_len - 1} (DeepSeek-V3's is 1), or raise data.seq_len above "
                        f"{depth}.")


def attach(model: Any, mtp: DictConfig) -> None:
    """Append ``mtp.depth`` MTP depths to a built DeepSeek-V3 model (``model.layers.{L + k - 1}``), initialised by
    the model's own ``_init_weights`` (so seeded builds are identical on every rank), and route its forward through
    ``_forward``. The config records the depth as DeepSeek's does (``num_nextn_predict_layers``)."""
    check(mtp, type(model).__name__)
    if mtp.depth == 0:
        return
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    c = model.config
    h, eps, first = c.hidden_size, c.rms_norm_eps, c.num_hidden_layers
    # A big model under ZeRO-3 is built partitioned (transformers' deepspeed.zero.Init): the depths too, each
    # parameter gathered to initialise it, or every rank would hold the whole depth (11.6B parameters at 671B).
    from transformers.integrations import is_deepspeed_zero3_enabled

    zero3 = is_deepspeed_zero3_enabled()

    def build() -> Any:
        if not zero3:
            return contextlib.nullcontext()
        import deepspeed
        from transformers.integrations import deepspeed_config

        return deepspeed.zero.Init(config_dict_or_path=deepspeed_config())

    def init(params: list) -> Any:
        if not zero3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    with _own_stream():  # the main model's random stream stays as without MTP
        for k in range(mtp.depth):
            with build():
                layer = DeepseekV3DecoderLayer(c, layer_idx=first + k)
                layer.enorm = DeepseekV3RMSNorm(h, eps=eps)
                layer.hnorm = DeepseekV3RMSNorm(h, eps=eps)
                layer.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
                layer.shared_head = torch.nn.Module()
                layer.shared_head.norm = DeepseekV3RMSNorm(h, eps=eps)
            layer.forward = _DepthForward(layer)
            model.model.layers.append(layer)
    c.num_nextn_predict_layers = mtp.depth
    model.shardyard_mtp_depth = mtp.depth
    init_depths(model, init)
    # The training targets, in a holder the forward keeps: ``training_targets`` reaches it through wrappers that
    # forward attribute reads to the model (peft's PeftModel) but would keep an attribute set on themselves.
    state: dict[str, Any] = {"targets": None}
    model.shardyard_mtp_state = state
    plain = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return _forward(model, plain, state["targets"], *args, **kwargs)

    model.forward = forward


def init_depths(model: Any, gathered: Any = None) -> None:
    """Initialise the MTP depths with the model's own ``_init_weights``, from a random stream of their own (the
    seed last set, plus 1): the same values whether the model was built on the CPU, on the meta device and
    materialised (``model.materialize``), or partitioned under ZeRO-3 (``gathered``: each module's parameters
    gathered to initialise them), and the main model's values as without MTP."""
    gathered = gathered or (lambda params: contextlib.nullcontext())
    hf = _hf(model)
    with _own_stream(), torch.no_grad():
        torch.manual_seed(torch.initial_seed() + 1)
        for layer in layers(model):
            for module in layer.modules():
                with gathered(list(module.parameters(recurse=False))):
                    hf._init_weights(module)


@contextlib.contextmanager
def main_only(model: Any) -> Iterator[None]:
    """Inside, ``model.model.layers`` holds the main layers only (the MTP depths set aside): for an initialisation
    of the main model that draws what it draws without MTP."""
    d = depth(model)
    kept, inner = layers(model), _hf(model).model
    if d:
        del inner.layers[len(inner.layers) - d:]
    try:
        yield
    finally:
        for layer in kept:
            inner.layers.append(layer)


class _DepthForward:
    """An MTP depth's forward, ``(h_{k-1}, Emb(t_{i+k}), **block kwargs) -> h_k``, h_k after the depth's final norm
    (``shared_head.norm``): what the shared head reads and what depth k+1 reads (Megatron-Core's chaining). The whole
    depth inside its module's own call, so that an engine that shards the depth as one unit (FSDP2's per-block
    ``fully_shard``) has gathered its norms and projection too. The block itself is the layer's class forward,
    looked up at each call: FSDP2 swaps the module's class, and transformers' activation checkpointing wraps the
    outermost class's forward only."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer

    def __call__(self, hidden: torch.Tensor, embeds: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        layer: Any = self.layer
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], dim=-1))
        return layer.shared_head.norm(type(layer).forward(layer, x, **kwargs))


def run_depths(model: Any, hidden: torch.Tensor, emb: torch.Tensor, ahead: list[torch.Tensor] | None = None,
               **block: Any) -> list[torch.Tensor]:
    """Each depth's output after its final norm (what the shared head reads), depth 1 first, from the main model's
    output ``hidden`` (after ``model.norm``) and the embedding ``emb`` of the input tokens; depth k reads depth
    k-1's normed output (Megatron-Core's chaining). Position i combines its own representation with token i+k's
    embedding (rolled: the last k positions wrap around, and have no target: ``depth_targets``; ``ahead``: those
    embeddings given, a sequence-parallel share's, whose tokens i+k may lie in the next share); causal attention
    keeps token i+k+1 out of position i's view."""
    out, prev = [], hidden
    for k, layer in enumerate(layers(model), 1):
        prev = layer(prev, ahead[k - 1] if ahead is not None else emb.roll(-k, dims=1), **block)
        out.append(prev)
    return out


@contextlib.contextmanager
def training_targets(model: Any, targets: torch.Tensor) -> Iterator[None]:
    """Inside, the model's forward returns the summed cross-entropy of the main head and of every depth,
    ``[main, depth 1, ..., depth D]`` (fp32), for these targets (the main loss's: ``targets[i]`` is token i+1)."""
    state = model.shardyard_mtp_state
    state["targets"] = targets
    try:
        yield
    finally:
        state["targets"] = None


def depth_targets(targets: torch.Tensor, position_ids: torch.Tensor | None, k: int) -> torch.Tensor:
    """Depth k's targets at each position i: token i+k+1, i.e. the main targets shifted left by k, and -100 (no
    loss) past the row's end and wherever token i+k+1 lies in another document than position i (packed documents
    or conversations: ``position_ids`` restart at 0 at each), so no depth predicts across a boundary. A padded or
    prompt token keeps the main targets' -100. A depth k >= the row's length has no target at all (all -100),
    never the rolled row's wrapped tokens (validation refuses ``model.mtp.depth >= data.seq_len``:
    ``check_seq_len``)."""
    t = targets.roll(-k, dims=-1).clone()
    t[..., max(t.size(-1) - k, 0):] = -100
    if position_ids is not None and k > 0:
        seg = (position_ids == 0).cumsum(-1)
        after = torch.cat([seg, seg[..., -1:].expand(*seg.shape[:-1], k + 1)], -1)[..., k + 1:]  # seg of i+k+1
        t = t.masked_fill(after != seg, -100)
    return t


def _ahead(inputs: Any) -> Any:
    """A sequence-parallel share's depth inputs and targets, taken from the whole sequence
    (``sequence_parallel.Batch.ahead``), or None."""
    from shardyard.models.loss import SEQUENCE_SHARDS

    return getattr(inputs.get(SEQUENCE_SHARDS), "ahead", None) if isinstance(inputs, dict) else None


def label_counts(inputs: Any, targets: torch.Tensor, d: int) -> torch.Tensor:
    """The label tokens of the main loss and of each depth: ``[main, depth 1, ..., depth D]`` (int64); of a
    sequence-parallel share, its own positions' (the whole sequence's depth targets, split)."""
    pos = inputs.get("position_ids") if isinstance(inputs, dict) else None
    ahead = _ahead(inputs)
    per_depth = ahead[1] if ahead else [depth_targets(targets, pos, k) for k in range(1, d + 1)]
    return torch.stack([(targets != -100).sum()] + [(t != -100).sum() for t in per_depth[:d]])


def term_weights(mtp: DictConfig | None, step: int) -> list[float]:
    """Each loss term's factor at training step ``step`` (counted from 1): 1 for the main loss, ``weight / D``
    for each depth (``final_weight / D`` from ``final_weight_from_step`` on). ``None`` (a model option without
    the key): the main loss alone."""
    if mtp is None or int(mtp.depth) == 0:
        return [1.0]
    d = int(mtp.depth)
    w = mtp.weight
    if mtp.get("final_weight") is not None and step >= mtp.final_weight_from_step:
        w = mtp.final_weight
    return [1.0] + [float(w) / d] * d


def term_factors(mtp: DictConfig | None, device: torch.device) -> Any:
    """``step -> term_weights(mtp, step)`` as a tensor on ``device``, each value the schedule takes copied there
    once: a host-to-device copy at every step would make the host wait for the step before."""
    made: dict[tuple[float, ...], torch.Tensor] = {}

    def at(step: int) -> torch.Tensor:
        w = tuple(term_weights(mtp, step))
        if w not in made:
            made[w] = torch.tensor(w, device=device)
        return made[w]

    return at


def head_sum(model: Any, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The output head's summed cross-entropy (fp32) of ``hidden`` against ``targets``: through the chunked head
    (``model.loss_chunk``, which reads its targets from ``head.shardyard_targets``) or the plain one."""
    head = model.get_output_embeddings()
    if getattr(model, "shardyard_loss_chunk", 0):
        head.shardyard_targets = targets
        try:
            return head(hidden)
        finally:
            head.shardyard_targets = None
    out = head(hidden)
    return F.cross_entropy(out.float().reshape(-1, out.size(-1)), targets.reshape(-1), ignore_index=-100,
                           reduction="sum")


def _forward(model: Any, plain: Any, targets: torch.Tensor | None, input_ids: torch.Tensor | None = None,
             attention_mask: Any = None, position_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """The forward of a model with MTP depths. Outside ``training_targets``: the plain causal LM's. Inside: the
    main model once, then each depth on the previous one's output, in the model's own forward (so every engine's
    hooks, DDP's, FSDP's root, ZeRO-3's, run as for any forward); returns the summed cross-entropies."""
    if targets is None:
        return plain(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    from transformers.masking_utils import create_causal_mask

    inner = model.model
    # kwargs: a sequence-parallel share's ``Batch`` (its attention over the whole sequence), for the depths too
    hidden = inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   **kwargs).last_hidden_state
    sums = [head_sum(model, hidden, targets)]
    emb = inner.embed_tokens(input_ids)  # the shared embedding (a lookup; its gradient adds up from every use)
    pos = position_ids if position_ids is not None else \
        torch.arange(emb.shape[1], device=emb.device).unsqueeze(0)
    mask = create_causal_mask(config=inner.config, inputs_embeds=emb, attention_mask=attention_mask, cache=None,
                              position_ids=pos)
    rope = inner.rotary_emb(emb, pos)
    ahead = _ahead(kwargs)  # a share's: the next tokens and the depths' targets across its edges (on the device)
    embeds = [inner.embed_tokens(ids) for ids in ahead[0]] if ahead else None
    normed = run_depths(model, hidden, emb, embeds, attention_mask=mask, position_embeddings=rope, position_ids=pos,
                        **kwargs)
    sums += [head_sum(model, n, ahead[1][k - 1] if ahead else depth_targets(targets, position_ids, k))
             for k, n in enumerate(normed, 1)]
    return torch.stack(sums)
