"""DeepSeek-V3's official checkpoint layout in and out (issue 43, point 4): a checkpoint written here under the
official names (two safetensors shards and an index, experts one by one, the MTP layer with its copies of the
embedding and head, and FP8 blocks with their scales quantised by the test itself) loads into a fresh model
tensor for tensor; the export writes the same layout, reloads to the same bytes, and transformers loads its main
model with our logits."""

import json
import math

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import Whole

from shardyard.training import export
from shardyard.core.errors import UserError
from shardyard.models.build import build_model
from shardyard.models.weights import load_weights, weights_dir

V, I, MAIN_LAYERS, E = 300, 200, 2, 4  # vocab and dense intermediate size not multiples of 128: partial FP8 blocks
SHAPE = dict(_target_="shardyard.models.build.deepseek_v3", name="official", vocab_size=V, hidden_size=64,
             intermediate_size=I, num_layers=MAIN_LAYERS, num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=2,
             moe_intermediate_size=32, first_k_dense_replace=1)
MTP = "model.layers.2"  # depth 1: model.layers.{num_hidden_layers}
FP8 = ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
       f"{MTP}.eh_proj.weight", *(f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(E)
                                  for p in ("gate_proj", "up_proj", "down_proj"))]
"""The tensors the FP8 checkpoint quantises: linear weights of every kind (dense, MTP projection, routed experts
stored one by one), as DeepSeek's release does (its embedding, head, norms and router stay in bf16/fp32)."""


def _m(depth: int, **keys):
    return OmegaConf.create({**SHAPE, **keys, "mtp": dict(depth=depth, weight=0.3, final_weight=None,
                                                         final_weight_from_step=None)})


def tiny(depth: int, seed: int = 0):
    return build_model(_m(depth), seed)


def official(model) -> dict[str, torch.Tensor]:
    """``model``'s tensors under DeepSeek-V3's official names, built by hand: each expert's projections apart (the
    fused ``gate_up_proj`` [E, 2I, H] holds gate's rows first), and in each MTP layer the copies of the embedding
    and head."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    if f"{MTP}.eh_proj.weight" in out:
        out[f"{MTP}.embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[f"{MTP}.shared_head.head.weight"] = out["lm_head.weight"].clone()
    return out


def write_shards(tensors: dict[str, torch.Tensor], path) -> None:
    """Two safetensors shards and ``model.safetensors.index.json``, as the official release is laid out."""
    names = list(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    path.mkdir(exist_ok=True)
    for f, part in halves.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(path / f))
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's FP8 format, by hand: per 128 x 128 block (the last ones partial) a scale = amax / 448, the
    block divided by it in float8_e4m3fn, and the scale stored as ``weight_scale_inv`` (what dequantising
    multiplies by)."""
    rows, cols = math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def dequantise(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The reference: every element times its own block's scale, element by element over the blocks."""
    w = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float() * s[i, j]
    return w


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_an_official_checkpoint_with_its_mtp_layer_loads_every_tensor(tmp_path, capsys):
    source = tiny(1)
    tensors = official(source)
    assert f"{MTP}.shared_head.head.weight" in tensors and "model.layers.1.mlp.experts.3.up_proj.weight" in tensors
    write_shards(tensors, tmp_path)
    fresh = tiny(1, seed=1)
    assert not torch.equal(fresh.model.layers[2].eh_proj.weight, source.model.layers[2].eh_proj.weight)
    load_weights(fresh, str(tmp_path))
    assert_same(fresh, source)
    out, err = capsys.readouterr()
    assert f"loaded the MTP depth 1 from {MTP}.*" in out
    assert "warning" not in err, err  # the copies are accepted (not "unused"), and equal to the main tensors


def test_copies_that_differ_from_the_main_tensors_are_named_once(tmp_path, capsys):
    tensors = official(tiny(1))
    tensors[f"{MTP}.shared_head.head.weight"] = tensors[f"{MTP}.shared_head.head.weight"] + 1
    write_shards(tensors, tmp_path)
    load_weights(tiny(1, seed=1), str(tmp_path))
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and f"{MTP}.shared_head.head.weight != lm_head.weight" in err, err
    assert "embed_tokens" not in err and "does not have" not in err, err


def test_a_model_without_mtp_is_told_what_the_checkpoint_holds(tmp_path, capsys):
    source = tiny(1)
    write_shards(official(source), tmp_path)
    plain = tiny(0, seed=1)
    load_weights(plain, str(tmp_path))
    main = {n: t for n, t in source.state_dict().items() if not n.startswith(MTP + ".")}
    assert main.keys() == plain.state_dict().keys()
    assert all(torch.equal(t, plain.state_dict()[n]) for n, t in main.items())
    err = capsys.readouterr().err
    assert f"holds a multi-token-prediction module ({MTP}.*" in err and "model.mtp.depth=1 would train it" in err, err
    assert "tensor(s) the model does not have" not in err, err  # not the generic list

    deeper = build_model(_m(0, num_layers=MAIN_LAYERS + 1), seed=0)  # its layer 2 is a main layer (no eh_proj)
    write_shards(official(deeper), tmp_path / "deeper")
    load_weights(tiny(0, seed=1), str(tmp_path / "deeper"))
    err = capsys.readouterr().err
    assert f"tensor(s) the model does not have, e.g. ['{MTP}." in err and "multi-token" not in err, err


def test_a_checkpoint_without_mtp_loads_the_main_model_and_starts_the_depth_fresh(tmp_path, capsys):
    """Continued pretraining of a model released without MTP (Kimi K2, Moonlight: DeepSeek-V3's layout,
    ``num_nextn_predict_layers: 0``): the main model is loaded, depth 1 keeps its seeded init."""
    write_shards(official(tiny(0)), tmp_path)
    model, init = tiny(1, seed=1), tiny(1, seed=1)
    load_weights(model, str(tmp_path))
    loaded = tiny(0)
    for name, t in model.state_dict().items():
        want = init.state_dict()[name] if name.startswith(MTP + ".") else loaded.state_dict()[name]
        assert torch.equal(t, want), name
    assert f"has no MTP depth 1 ({MTP}.*): the main model is loaded and this depth starts from a fresh init" in \
        capsys.readouterr().out

    tensors = official(tiny(1))  # a depth the checkpoint holds only in part is a broken checkpoint: refused
    del tensors[f"{MTP}.eh_proj.weight"]
    write_shards(tensors, tmp_path / "partial")
    with pytest.raises(UserError) as e:
        load_weights(tiny(1, seed=1), str(tmp_path / "partial"))
    assert e.value.key == "model.weights" and f"{MTP}.eh_proj.weight" in e.value.paragraph()


def test_fp8_blocks_are_dequantised_with_their_scales(tmp_path, capsys):
    source = tiny(1)
    tensors = official(source)
    want = {}
    for name in FP8:
        q, s = quantise(tensors[name])
        tensors[name], tensors[name + "_scale_inv"] = q, s
        want[name] = dequantise(q, s)
    assert list(tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape) == [2, 1]  # 200 rows: 1.56 blocks
    assert list(tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape) == [1, 2]
    write_shards(tensors, tmp_path)
    fresh = tiny(1, seed=1)
    load_weights(fresh, str(tmp_path))
    got = fresh.state_dict()
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], want["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(got["model.layers.0.mlp.gate_proj.weight"], want["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"], want["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(got[f"{MTP}.eh_proj.weight"], want[f"{MTP}.eh_proj.weight"])
    experts = "model.layers.1.mlp.experts"
    assert torch.equal(got[f"{experts}.gate_up_proj"], torch.stack(
        [torch.cat([want[f"{experts}.{e}.gate_proj.weight"], want[f"{experts}.{e}.up_proj.weight"]]) for e in range(E)]))
    assert torch.equal(got[f"{experts}.down_proj"], torch.stack([want[f"{experts}.{e}.down_proj.weight"] for e in range(E)]))
    assert not torch.equal(got[f"{MTP}.eh_proj.weight"], source.model.layers[2].eh_proj.weight)  # quantised
    quantised = {"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 f"{MTP}.eh_proj.weight", f"{experts}.gate_up_proj", f"{experts}.down_proj"}
    for name, t in source.state_dict().items():  # the rest as stored
        if name not in quantised:
            assert torch.equal(got[name], t), name
    assert "warning" not in capsys.readouterr().err  # the scales are read, not "unused"


def test_an_fp8_slice_reads_its_rows_and_columns_only(tmp_path):
    """The FSDP path reads each rank's rows through the same slice: ranges across block edges, as well as the
    whole tensor, equal the reference dequantisation's."""
    from shardyard.models.weights import _BlockFP8

    w = torch.randn(300, 260)
    q, s = quantise(w)
    save_file({"w": q, "w_scale_inv": s}, str(tmp_path / "x.safetensors"))
    ref = dequantise(q, s)
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as st:
        sl = _BlockFP8(st.get_slice("w"), st.get_slice("w_scale_inv"), "w", str(tmp_path))
        assert torch.equal(sl[:], ref)
        for rows, cols in [(slice(0, 75), slice(None)), (slice(75, 150), slice(None)), (slice(127, 129), slice(3, 259)),
                           (slice(256, 300), slice(128, 260)), (slice(5, 6), slice(255, 256))]:
            assert torch.equal(sl[rows, cols], ref[rows, cols]), (rows, cols)


@pytest.mark.parametrize("stored,needle", [
    (lambda t: {"lm_head.weight": t.to(torch.float8_e4m3fn)}, "F8_E4M3"),  # FP8 without its scales
    (lambda t: {"lm_head.weight": t.to(torch.int8), "lm_head.weight_scale_inv": torch.ones(3, 1)}, "I8"),
])
def test_other_quantised_tensors_stay_refused(tmp_path, stored, needle):
    tensors = official(tiny(1))
    tensors.update(stored(tensors["lm_head.weight"]))
    write_shards(tensors, tmp_path)
    with pytest.raises(UserError) as e:
        load_weights(tiny(1, seed=1), str(tmp_path))
    assert e.value.key == "model.weights" and f"lm_head.weight is stored as {needle}" in str(e.value)




@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V - 1)} | {"<unk>": V - 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(path))
    return str(path)


def _tensors(path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_the_export_writes_the_official_layout_and_reloads_to_the_same_bytes(tmp_path, tokenizer_dir, capsys):
    from transformers import AutoModelForCausalLM

    source = tiny(1)
    first = tmp_path / "hf"
    export.save_hf(Whole(source), tokenizer_dir, str(first))
    config = json.loads((first / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == MAIN_LAYERS
    written = _tensors(first)
    assert torch.equal(written[f"{MTP}.embed_tokens.weight"], source.model.embed_tokens.weight)
    assert torch.equal(written[f"{MTP}.shared_head.head.weight"], source.lm_head.weight)
    assert torch.equal(written[f"{MTP}.eh_proj.weight"], source.model.layers[2].eh_proj.weight)
    assert f"{MTP}.mlp.experts.0.gate_proj.weight" in written  # transformers' per-expert layout, as the release's
    assert written.keys() == official(source).keys()

    again = tiny(1, seed=1)
    load_weights(again, str(first))
    assert_same(again, source)
    assert "warning" not in capsys.readouterr().err
    second = tmp_path / "hf2"
    export.save_hf(Whole(again), tokenizer_dir, str(second))
    rewritten = _tensors(second)
    assert rewritten.keys() == written.keys()
    for name, t in written.items():
        r = rewritten[name]
        assert r.dtype == t.dtype and r.shape == t.shape and bytes(r.reshape(-1).view(torch.uint8).numpy()) == \
            bytes(t.reshape(-1).view(torch.uint8).numpy()), name

    hf = AutoModelForCausalLM.from_pretrained(str(first), dtype=torch.float32).eval()
    source.eval()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, source(ids).logits)
    assert len(hf.model.layers) == MAIN_LAYERS


def test_a_depth_0_export_says_it_holds_no_mtp(tmp_path, tokenizer_dir):
    export.save_hf(Whole(tiny(0)), tokenizer_dir, str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert not any(n.startswith(MTP + ".") for n in _tensors(tmp_path / "hf"))


def test_model_hf_of_an_export_keeps_the_users_depth(tmp_path, tokenizer_dir, capsys):
    """``model=hf model.path=EXPORT``: its config says num_nextn_predict_layers 1, and model.mtp.depth decides."""
    source = tiny(1)
    export.save_hf(Whole(source), tokenizer_dir, str(tmp_path / "hf"))
    capsys.readouterr()
    for depth in (0, 1):
        m = OmegaConf.create({"_target_": "shardyard.models.build.hf", "name": "hf", "path": str(tmp_path / "hf"),
                              "weights": "auto", "mtp": dict(depth=depth, weight=0.3, final_weight=None,
                                                             final_weight_from_step=None)})
        model = build_model(m, seed=1)
        assert len(model.model.layers) == MAIN_LAYERS + depth
        load_weights(model, weights_dir(m))
        for name, t in model.state_dict().items():
            assert torch.equal(t, source.state_dict()[name]), name
        out, err = capsys.readouterr()
        if depth:
            assert f"loaded the MTP depth 1 from {MTP}.*" in out and "warning" not in err, err
        else:
            assert "model.mtp.depth=1 would train it" in err and "does not have, e.g." not in err, err


def test_an_fp8_releases_config_is_not_carried_into_the_model_or_its_export(tmp_path, tokenizer_dir):
    """DeepSeek-V3's FP8 release says ``quantization_config`` (fp8, 128 x 128 blocks) in its config.json; its weights
    are dequantised as they load and train in high precision, so ``model=hf`` builds an unquantised model and the
    export's config.json says nothing of FP8 (transformers or vLLM would read the bf16/fp32 tensors as FP8)."""
    export.save_hf(Whole(tiny(1)), tokenizer_dir, str(tmp_path / "release"))
    cfg_file = tmp_path / "release" / "config.json"
    config = json.loads(cfg_file.read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    cfg_file.write_text(json.dumps(config))
    m = OmegaConf.create({"_target_": "shardyard.models.build.hf", "name": "hf", "path": str(tmp_path / "release"),
                          "weights": "auto", "mtp": dict(depth=1, weight=0.3, final_weight=None,
                                                         final_weight_from_step=None)})
    model = build_model(m, seed=1)
    assert getattr(model.config, "quantization_config", None) is None
    export.save_hf(Whole(model), tokenizer_dir, str(tmp_path / "out"))
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
