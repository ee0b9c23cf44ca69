"""The export's shard files (``export._ShardWriter``, ``export._split``), written to real files and read back with
safetensors itself: a file streamed tensor by tensor is what ``safetensors.torch.save_file`` would hold, for every
dtype an export can carry, and a rank's tensors are split into files as ``save_pretrained`` splits them."""

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from shardyard.training import export
from shardyard.planning.rules import _safetensors_problem

TENSORS = {"a.weight": torch.randn(5, 3), "b.bias": torch.randn(7).to(torch.bfloat16), "c.scale": torch.tensor(2.5),
           "d.mask": torch.rand(4, 4) > 0.5, "e.index": torch.arange(6, dtype=torch.int64).reshape(2, 3),
           "f.half": torch.randn(3, 1, 2).to(torch.float16), "g.byte": torch.arange(3, dtype=torch.uint8)}


def entries(tensors):
    return [(k, list(v.shape), v.dtype) for k, v in tensors.items()]


def test_a_streamed_shard_file_reads_back_as_safetensors(tmp_path):
    files = [f"model-0000{1 if i < 4 else 2}-of-00002.safetensors" for i in range(len(TENSORS))]
    writer = export._ShardWriter(str(tmp_path), [(f, *e) for f, e in zip(files, entries(TENSORS))])
    for k, v in TENSORS.items():
        writer.write(k, v)
    writer.close()
    assert writer.error is None
    got = {}
    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert _safetensors_problem(str(tmp_path / f)) is None
        with safe_open(str(tmp_path / f), framework="pt") as st:
            assert st.metadata() == {"format": "pt"}
        got.update(load_file(str(tmp_path / f)))
    assert got.keys() == TENSORS.keys()
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in TENSORS.items())
    assert writer.written == dict(zip(TENSORS, files))
    assert writer.size == sum(v.numel() * v.element_size() for v in TENSORS.values())


def test_a_non_contiguous_tensor_is_written_by_value(tmp_path):
    t = torch.randn(3, 5).t()  # a transposed view
    writer = export._ShardWriter(str(tmp_path), [("model.safetensors", "w", [5, 3], torch.float32)])
    writer.write("w", t)
    writer.close()
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["w"], t)


def test_a_tensor_the_plan_does_not_expect_is_reported_not_written(tmp_path):
    writer = export._ShardWriter(str(tmp_path), [("model.safetensors", "w", [2], torch.float32),
                                                 ("model.safetensors", "v", [2], torch.float32)])
    writer.write("w", torch.zeros(3))
    writer.write("v", torch.zeros(2))  # skipped: the export is already failed
    writer.close()
    assert "w [3] torch.float32 came where the plan has w [2]" in writer.error and writer.written == {}


def test_tensors_split_into_files_as_save_pretrained_splits_them(monkeypatch, tmp_path):
    """huggingface_hub's rule, tensor > max included: that one gets a file of its own while the current file goes
    on, so two files are open at once, each still written front to back."""
    from huggingface_hub import split_torch_state_dict_into_shards

    tensors = {f"t{i}": torch.randn(n) for i, n in enumerate([10, 30, 5, 60, 1, 1, 25, 24])}
    monkeypatch.setattr(export, "MAX_SHARD_BYTES", 160)  # 40 fp32 values; t3 is bigger alone
    ours = [[name for name, _, _ in f] for f in export._split(entries(tensors))]
    hf = split_torch_state_dict_into_shards(tensors, max_shard_size=160)
    assert ours == [list(names) for names in hf.filename_to_tensors.values()] and len(ours) == 4
    file_of = {name: f"f{i}.safetensors" for i, names in enumerate(ours) for name in names}
    writer = export._ShardWriter(str(tmp_path), [(file_of[k], *e) for k, e in zip(tensors, entries(tensors))])
    for k, v in tensors.items():
        writer.write(k, v)
    assert writer.error is None and not writer._open
    for i, names in enumerate(ours):
        got = load_file(str(tmp_path / f"f{i}.safetensors"))
        assert list(got) == names and all(torch.equal(got[k], tensors[k]) for k in names)
