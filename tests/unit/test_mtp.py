"""DeepSeek-V3's multi-token prediction (``model.mtp``, issue 43): each depth's loss against a reference built by
hand from the model's own submodules, the label counts and term weights the loop reads, what evaluation and
sampling see, the bad values, and the seeded build."""

import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from shardyard.models import mtp, prepare as model_lib
from shardyard.core.errors import UserError
from shardyard.models.build import build_model, materialize
from shardyard.models.loss import causal_lm_loss, causal_lm_loss_sum
from shardyard.models.prepare import apply_chunked_loss
from shardyard.testing import compose
from shardyard.planning.validate import validate

V, L, MAIN_LAYERS = 96, 16, 2
SHAPE = dict(_target_="shardyard.models.build.deepseek_v3", name="mtp_test", vocab_size=V, hidden_size=64,
             intermediate_size=128, num_layers=MAIN_LAYERS, num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
             moe_intermediate_size=32, first_k_dense_replace=1)


def _m(depth: int | None, **mtp_keys):
    keys = dict(SHAPE)
    if depth is not None:
        keys["mtp"] = dict(depth=depth, weight=0.3, final_weight=None, final_weight_from_step=None, **mtp_keys)
    return OmegaConf.create(keys)


def tiny(depth: int | None, seed: int = 0):
    """A tiny DeepSeek-V3 with ``depth`` MTP depths (None: no ``model.mtp`` key at all)."""
    return build_model(_m(depth), seed)


def main_part(model):
    """A model without MTP holding ``model``'s main weights (the same seed, then its main state loaded)."""
    plain = tiny(None, seed=123)
    state = {n: t for n, t in model.state_dict().items()
             if not any(n.startswith(f"model.layers.{MAIN_LAYERS + k}.") for k in range(mtp.depth(model)))}
    plain.load_state_dict(state)
    return plain


def documents(ids: torch.Tensor, docs: list[list[int]] | None):
    """The document of each position (``docs``: each row's document lengths; None: one document per row) and
    the positions, restarting at 0 at each document."""
    B, n = ids.shape
    lengths = docs or [[n]] * B
    assert all(sum(row) == n for row in lengths)
    doc = torch.tensor([[d for d, length in enumerate(row) for _ in range(length)] for row in lengths])
    pos = torch.tensor([[p for length in row for p in range(length)] for row in lengths])
    return doc, pos


def hand_labels(targets: torch.Tensor, doc: torch.Tensor, k: int) -> torch.Tensor:
    """Depth k's labels, one position at a time: position i predicts token i+k+1, which is ``targets[i+k]`` (the
    main targets: ``targets[i]`` is token i+1), when that token is in the row's data and in i's document (the
    token after the row continues the row's last document); otherwise -100. Depth 0: the main targets as given
    (the data's, whose target at a document's last token is the next document's first)."""
    B, n = targets.shape
    out = torch.full_like(targets, -100)
    for b in range(B):
        doc_of = doc[b].tolist() + [doc[b, -1].item()]  # doc_of[j]: the document of token j (j = n: after the row)
        for i in range(n - k):
            if k == 0 or doc_of[i + k + 1] == doc_of[i]:
                out[b, i] = targets[b, i + k]
    return out


def reference(model, ids: torch.Tensor, targets: torch.Tensor, docs: list[list[int]] | None = None,
              chain: str = "normed"):
    """``[main, depth 1, ..., depth D]`` summed cross-entropies, computed by hand: the main trunk layer by layer,
    then each depth from the paper's formula, with a (block-diagonal) causal mask and shifted ids built here.
    ``chain``: what depth k+1 reads of depth k, its output after ``shared_head.norm`` (``normed``: Megatron-Core's
    ``final_layernorm`` output, shardyard's choice) or before it (``raw``: the other reading of the paper)."""
    inner, D = model.model, mtp.depth(model)
    B, n = ids.shape
    doc, pos = documents(ids, docs)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = ((j <= i)[None] & (doc[:, :, None] == doc[:, None, :]))[:, None]  # [B, 1, n, n]: True = attends

    def run(layer, h):  # the decoder block itself (HF's), whatever forward shardyard gives the module
        return DeepseekV3DecoderLayer.forward(layer, h, attention_mask=mask, position_embeddings=rope, position_ids=pos)

    emb = inner.embed_tokens(ids)
    rope = inner.rotary_emb(emb, pos)
    h = emb
    for layer in inner.layers[:MAIN_LAYERS]:
        h = run(layer, h)
    prev = inner.norm(h)  # h_0: the main model's output, after its final norm

    def ce(hidden, labels):
        out = model.lm_head(hidden).float()
        return F.cross_entropy(out.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="sum")

    sums = [ce(prev, hand_labels(targets, doc, 0))]
    for k in range(1, D + 1):
        layer = inner.layers[MAIN_LAYERS + k - 1]
        ahead = torch.zeros_like(ids)  # token i+k at position i; the last k positions have none (and no label)
        ahead[:, :n - k] = ids[:, k:]
        x = layer.eh_proj(torch.cat([layer.enorm(inner.embed_tokens(ahead)), layer.hnorm(prev)], dim=-1))
        raw = run(layer, x)
        normed = layer.shared_head.norm(raw)
        sums.append(ce(normed, hand_labels(targets, doc, k)))
        prev = normed if chain == "normed" else raw
    return torch.stack(sums)


def batch(seed: int = 0, B: int = 2):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, V, (B, L + 1), generator=g)
    return rows[:, :-1], rows[:, 1:].clone()  # ids, and the main targets (token i+1) as the data gives them


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("depth", [1, 2])
def test_each_depth_loss_equals_the_hand_built_reference(depth):
    model = tiny(depth)
    assert len(model.model.layers) == MAIN_LAYERS + depth and model.config.num_nextn_predict_layers == depth
    ids, y = batch()
    sums = causal_lm_loss_sum(model, ids, y)
    assert sums.shape == (depth + 1,) and sums.dtype == torch.float32
    close(sums, reference(model, ids, y))
    assert (sums[1:] > 0).all() and not torch.allclose(sums[1:], sums[0].expand(depth))  # each depth a term of its own
    # the loop's counts: the main targets' labels, then L - k per row for depth k (no packed documents here)
    counts = mtp.label_counts(ids, y, depth)
    assert counts.tolist() == [ids.numel()] + [ids.size(0) * (L - k) for k in range(1, depth + 1)]


def test_depth_two_reads_depth_one_after_its_final_norm():
    """The chaining of depths (Megatron-Core's ``MultiTokenPredictionBlock``: each layer returns its
    ``final_layernorm`` output, which its converters write as ``shared_head.norm``, and the next layer reads that):
    depth 2's loss computed by hand from depth 1's normed output, with depth 1's ``shared_head.norm`` weights far
    from 1 (at their initial 1s the two readings agree to ~1e-6, so only such weights tell them apart) and a head
    10x sharper than at initialisation (near-uniform logits would hide depth 2's input in its loss)."""
    model = tiny(2)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
        for k in (0, 1):
            norm = model.model.layers[MAIN_LAYERS + k].shared_head.norm.weight
            norm.copy_(torch.rand(norm.shape, generator=g) * 2.8 + 0.2)  # in [0.2, 3]
    ids, y = batch(8)
    sums = causal_lm_loss_sum(model, ids, y)
    inner, depth1, depth2 = model.model, model.model.layers[MAIN_LAYERS], model.model.layers[MAIN_LAYERS + 1]
    # by hand: h_0 after model.norm; h_1 = depth 1's block output after its shared_head.norm; depth 2 reads h_1
    pos = torch.arange(L)[None].expand(ids.size(0), L)
    mask = torch.ones(L, L, dtype=torch.bool).tril()[None, None].expand(ids.size(0), 1, L, L)
    emb = inner.embed_tokens(ids)
    rope = inner.rotary_emb(emb, pos)

    def block(layer, h_prev, k):
        ahead = torch.zeros_like(ids)
        ahead[:, :L - k] = ids[:, k:]
        x = layer.eh_proj(torch.cat([layer.enorm(inner.embed_tokens(ahead)), layer.hnorm(h_prev)], -1))
        return DeepseekV3DecoderLayer.forward(layer, x, attention_mask=mask, position_embeddings=rope, position_ids=pos)

    with torch.no_grad():
        h0 = inner(input_ids=ids).last_hidden_state
        raw1 = block(depth1, h0, 1)
        h1 = depth1.shared_head.norm(raw1)
        labels2 = torch.full_like(y, -100)
        labels2[:, :L - 2] = y[:, 2:]
        want = F.cross_entropy(model.lm_head(depth2.shared_head.norm(block(depth2, h1, 2))).float().reshape(-1, V),
                               labels2.reshape(-1), ignore_index=-100, reduction="sum")
        other = F.cross_entropy(model.lm_head(depth2.shared_head.norm(block(depth2, raw1, 2))).float().reshape(-1, V),
                                labels2.reshape(-1), ignore_index=-100, reduction="sum")
    close(sums[2].detach(), want)
    close(sums.detach(), reference(model, ids, y, chain="normed").detach())
    # the other chaining (depth 1's output before shared_head.norm) gives another depth-2 loss: told apart here
    assert (other - want).abs() > 5e-3 * want.abs(), (other, want)  # 1.05% here; close() resolves 1e-5
    close(reference(model, ids, y, chain="raw")[:2].detach(), sums[:2].detach())  # depths <= 1 are the same either way


def test_prompt_masks_and_padding_keep_their_labels_out_of_every_depth():
    model = tiny(2)
    ids, y = batch(1)
    y[:, :5] = -100  # a prompt: no loss on its tokens
    ids[1, 11:] = 0  # row 1 padded after its 11 real tokens (the last one's target: -100 too)
    y[1, 10:] = -100
    sums = causal_lm_loss_sum(model, ids, y)
    close(sums, reference(model, ids, y))
    doc, _ = documents(ids, None)
    want = [(hand_labels(y, doc, k) != -100).sum().item() for k in range(3)]
    # a label moves k positions left at depth k, so each depth keeps all 11 + 5 (the prompt's last k positions
    # predict the answer's tokens k+1 ahead), and none is a padded or prompt token's
    assert mtp.label_counts(ids, y, 2).tolist() == want == [11 + 5] * 3


def test_packed_documents_are_not_predicted_across():
    model = tiny(2)
    ids, y = batch(2)
    docs = [[5, 7, 4], [3, 13]]  # row 0: three documents, row 1: two
    _, pos = documents(ids, docs)
    inputs = {"input_ids": ids, "position_ids": pos}
    sums = causal_lm_loss_sum(model, inputs, y)
    close(sums, reference(model, ids, y, docs))
    doc, _ = documents(ids, docs)
    want = [(hand_labels(y, doc, k) != -100).sum().item() for k in range(3)]
    # depth k loses k + 1 labels at the end of each document but a row's last (there k, as at any row's end): the
    # main target of a document's last token is the next document's first, which no depth predicts
    assert mtp.label_counts(inputs, y, 2).tolist() == want == [32, 32 - (2 + 2 + 1) - (2 + 1), 32 - 8 - 5]
    # the main term is the plain model's loss on the same weights and the same packed inputs
    close(sums[0], causal_lm_loss_sum(main_part(model), inputs, y))


def test_the_chunked_head_gives_the_same_terms():
    model = tiny(2)
    ids, y = batch(3)
    want = reference(model, ids, y)
    apply_chunked_loss(model, OmegaConf.create({"loss_chunk": 7}))
    before = model_lib._PROBED["loss_chunks"]
    sums = causal_lm_loss_sum(model, ids, y)
    close(sums, want)
    assert model_lib._PROBED["loss_chunks"] - before == 3 * math.ceil(ids.numel() / 7)  # every term in chunks


@pytest.mark.parametrize("chunk", [0, 5])
def test_the_shared_embedding_and_head_get_the_depths_gradient(chunk):
    model = tiny(2)
    if chunk:
        apply_chunked_loss(model, OmegaConf.create({"loss_chunk": chunk}))
    ids, y = batch(4)

    def grads(terms):
        model.zero_grad(set_to_none=True)
        terms[1:].sum().backward()  # the MTP terms only
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got, want = grads(causal_lm_loss_sum(model, ids, y)), grads(reference(model, ids, y))
    assert got.keys() == want.keys()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert want[name].abs().sum() > 0, name
    for name in want:
        close(got[name], want[name], 1e-4)
    assert want["model.norm.weight"].abs().sum() > 0  # h_0 is taken after the main model's final norm


def test_evaluation_and_logits_are_the_main_models():
    model = tiny(2)
    plain = main_part(model)
    ids, y = batch(5)
    assert torch.equal(model(ids).logits, plain(ids).logits)
    assert torch.equal(causal_lm_loss(model, ids, y), causal_lm_loss(plain, ids, y))
    _, pos = documents(ids, [[9, 7], [16]])
    inputs = {"input_ids": ids, "position_ids": pos}
    assert torch.equal(causal_lm_loss(model, inputs, y), causal_lm_loss(plain, inputs, y))
    # the training main term is the evaluation's sum
    close(causal_lm_loss_sum(model, ids, y)[0], causal_lm_loss(plain, ids, y) * y.numel())


def test_term_weights_follow_the_schedule():
    cfg = OmegaConf.create(dict(depth=2, weight=0.3, final_weight=0.1, final_weight_from_step=5))
    for step in (1, 4):
        assert mtp.term_weights(cfg, step) == pytest.approx([1.0, 0.15, 0.15])
    for step in (5, 6, 10_000):
        assert mtp.term_weights(cfg, step) == pytest.approx([1.0, 0.05, 0.05])
    cfg.final_weight, cfg.final_weight_from_step = None, None
    assert mtp.term_weights(cfg, 10_000) == pytest.approx([1.0, 0.15, 0.15])
    cfg.depth = 1
    assert mtp.term_weights(cfg, 1) == pytest.approx([1.0, 0.3])
    cfg.depth = 0
    assert mtp.term_weights(cfg, 1) == [1.0]


@pytest.mark.parametrize("overrides, key", [
    (["model=deepseek_moe_tiny", "model.mtp.depth=-1"], "model.mtp.depth"),
    (["model=deepseek_moe_tiny", "model.mtp.depth=1", "model.mtp.weight=-0.1"], "model.mtp.weight"),
    (["model=deepseek_tiny", "model.mtp.depth=1"], "model.mtp.depth"),  # LLaMA: no MTP
    (["model=deepseek_moe_tiny", "model.mtp.depth=1", "model.mtp.final_weight=0.1"],
     "model.mtp.final_weight_from_step"),
    (["model=deepseek_moe_tiny", "model.mtp.depth=1", "model.mtp.final_weight=0.1",
      "model.mtp.final_weight_from_step=0"], "model.mtp.final_weight_from_step"),
    (["model=deepseek_moe_tiny", "model.mtp.depth=1", "model.mtp.final_weight=-0.1",
      "model.mtp.final_weight_from_step=5"], "model.mtp.final_weight"),
    # a depth must leave targets in a row (depth 40 on 32 tokens trained on the token 8 ahead: issue 53)
    (["model=deepseek_moe_tiny", "model.mtp.depth=40", "data.seq_len=32"], "model.mtp.depth"),
    (["model=deepseek_moe_tiny", "model.mtp.depth=32", "data.seq_len=32"], "model.mtp.depth"),
])
def test_bad_values_are_refused_naming_the_key(overrides, key):
    with pytest.raises(UserError) as e:
        validate(compose(overrides), None)
    assert e.value.key == key, e.value.paragraph()


def test_a_depth_never_trains_on_wrapped_targets():
    """The bound (depth <= data.seq_len - 1, the paragraph naming it) and the code path's own guard: a depth with no
    room in the row has no target at all, not the rolled row's wrapped tokens."""
    mtp.check_seq_len(31, 32)  # one target per row left: allowed
    with pytest.raises(UserError) as e:
        mtp.check_seq_len(40, 32)
    text = e.value.paragraph()
    assert e.value.key == "model.mtp.depth" and "40" in text and "model.mtp.depth<=31" in text, text
    _, y = batch(9)
    for k in (L, L + 1, L + 8, 3 * L):
        assert (mtp.depth_targets(y, None, k) == -100).all(), k
        assert mtp.label_counts({"input_ids": y}, y, k)[-1] == 0
    assert (mtp.depth_targets(y, None, L - 1)[:, 0] == y[:, L - 1]).all()  # the last depth with a target


def test_the_mtp_build_is_seeded():
    a, b, c = tiny(2, seed=0), tiny(2, seed=0), tiny(2, seed=1)

    def depths(model):
        return {n: p for n, p in model.named_parameters() if n.startswith(("model.layers.2.", "model.layers.3."))}

    pa, pb, pc = depths(a), depths(b), depths(c)
    assert pa.keys() == pb.keys() == pc.keys()
    for extra in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert f"model.layers.2.{extra}" in pa and f"model.layers.3.{extra}" in pa
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    random = [n for n in pa if n.endswith("eh_proj.weight") or "self_attn" in n and "layernorm" not in n]
    assert random and all(not torch.equal(pa[n], pc[n]) for n in random), random
    eh = pa["model.layers.2.eh_proj.weight"]
    assert abs(eh.std().item() - 0.02) < 2e-3 and torch.equal(pa["model.layers.2.enorm.weight"], torch.ones(64))
    # the embedding and the head are shared, not copied: the depths add their own modules only
    plain = tiny(None)
    per_depth = sum(p.numel() for p in a.model.layers[MAIN_LAYERS].parameters())
    assert sum(p.numel() for p in a.parameters()) == sum(p.numel() for p in plain.parameters()) + 2 * per_depth
    # a big model's meta build materialises the depths with the same initialisation
    meta = build_model(_m(2), 0, on_meta=True)
    materialize(meta, torch.device("cpu"), 0)
    pm = depths(meta)
    assert abs(pm["model.layers.3.eh_proj.weight"].std().item() - 0.02) < 2e-3
    assert torch.equal(pm["model.layers.3.shared_head.norm.weight"], torch.ones(64))
    # ... with the same values as the CPU build (the depths draw from their own stream: mtp.init_depths), and the
    # main model's as the meta build without MTP (the depths set aside while it initialises): engines that build
    # on the meta device, under ZeRO-3's partitioned init, or on the CPU start from the same depths
    assert all(torch.equal(pm[n], pa[n]) for n in pa), [n for n in pa if not torch.equal(pm[n], pa[n])][:3]
    bare = build_model(_m(None), 0, on_meta=True)
    materialize(bare, torch.device("cpu"), 0)
    main = dict(bare.named_parameters())
    assert all(torch.equal(t, main[n]) for n, t in meta.named_parameters() if n in main)


def test_depth_zero_leaves_the_model_as_it_was():
    without, zero = tiny(None), tiny(0)
    assert mtp.depth(zero) == 0 and mtp.layers(zero) == []
    s, z = without.state_dict(), zero.state_dict()
    assert list(s) == list(z) and all(torch.equal(s[n], z[n]) for n in s)
    assert without.config.to_dict() == zero.config.to_dict()
    assert "forward" not in vars(zero)  # the plain forward, not the MTP one


def test_lora_adapters_train_the_depths_too():
    """``peft=lora`` wraps the model in peft's PeftModel, which forwards attribute reads to the model but keeps
    attributes set on itself: the training loss still reaches the depths (its terms equal the hand-built
    reference with the adapters at their zero init), and the depths' adapters get a gradient from the MTP term."""
    from shardyard.models import adapters

    model = tiny(1)
    ids, y = batch()
    want = reference(model, ids, y)
    p = compose(["model=deepseek_moe_tiny", "peft=lora", "peft.target_modules=[q_proj,o_proj,eh_proj]"]).peft
    wrapped = adapters.apply(model, p, 0, torch.float32)
    sums = causal_lm_loss_sum(wrapped, ids, y)
    assert sums.shape == (2,), sums.shape
    close(sums.detach(), want.detach())
    sums[1].backward()
    depth_lora = [q for n, q in wrapped.named_parameters() if f"layers.{MAIN_LAYERS}." in n and "lora_" in n]
    assert depth_lora and any(q.grad is not None and q.grad.abs().sum() > 0 for q in depth_lora)


def test_lora_on_a_meta_build_materialises_the_depths():
    """``model.weights`` builds on the meta device and peft wraps the model before the engine materialises it
    (``worker.build``): the depths, reached through the PeftModel, get storage and their initialisation (norms 1,
    projections of std 0.02), the same for the same seed."""
    from shardyard.models import adapters

    p = compose(["model=deepseek_moe_tiny", "peft=lora", "peft.target_modules=[q_proj,o_proj,eh_proj]"]).peft

    def depths():
        wrapped = adapters.apply(build_model(_m(1), 0, on_meta=True), p, 0, torch.float32)
        materialize(wrapped, torch.device("cpu"), 0)
        assert not any(q.is_meta for q in wrapped.parameters())
        return {n: q for n, q in wrapped.named_parameters() if f"layers.{MAIN_LAYERS}." in n and "lora_" not in n}

    a, b = depths(), depths()
    assert all(torch.equal(a[n], b[n]) for n in a)
    eh = next(q for n, q in a.items() if n.endswith("eh_proj.base_layer.weight"))
    enorm = next(q for n, q in a.items() if n.endswith("enorm.weight"))
    assert abs(eh.std().item() - 0.02) < 2e-3 and torch.equal(enorm, torch.ones(64))
