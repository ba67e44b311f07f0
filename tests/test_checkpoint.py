import json
import shutil

import pytest
import torch

import monodecode
from safetensors import safe_open
from safetensors.torch import save_file

from monodecode import formats
from monodecode.checkpoint import (
    INDEX_FILE,
    Checkpoint,
    CheckpointError,
    SyntheticCheckpoint,
    canonical_name,
    write_synthetic_checkpoint,
)
from monodecode.config import preset
from monodecode.schema import tensor_specs


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_synthetic_checkpoint(preset("tiny"), tmp_path_factory.mktemp("ckpt") / "tiny",
                                      seed=7, progress=False)


def copy_of(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def test_synthetic_checkpoint_is_complete_and_valid(tiny_dir):
    ckpt = Checkpoint(tiny_dir)
    assert ckpt.config == preset("tiny")
    ckpt.validate(require_draft=True)
    assert ckpt.has_draft
    stored = {n for s in tensor_specs(ckpt.config) for n in s.stored()}
    assert set(ckpt._where) == stored
    index = json.loads((tiny_dir / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == stored
    # one shard a layer, one a draft stage, one for the top level
    assert len(set(index["weight_map"].values())) == 1 + 4 + 3


def test_synthetic_checkpoint_formats(tiny_dir):
    ckpt = Checkpoint(tiny_dir)
    c = ckpt.config
    q, s = ckpt.tensor("layers.1.attn.wq_b.weight"), ckpt.tensor("layers.1.attn.wq_b.scale")
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert q.shape == (c.num_attention_heads * c.head_dim, c.q_lora_rank)
    assert s.shape == (c.num_attention_heads * c.head_dim // 32, c.q_lora_rank // 32)
    w = formats.dequantize_fp8_block(q, s, c.fp8_block, torch.float32)
    assert torch.isfinite(w).all() and w.std() > 0
    # the stored values are representable: requantizing them loses nothing
    q2, s2 = formats.quantize_fp8_block(w, c.fp8_block)
    assert torch.equal(formats.dequantize_fp8_block(q2, s2, c.fp8_block, torch.float32), w)
    packed = ckpt.tensor("layers.3.ffn.experts.5.w2.weight")
    assert packed.dtype == torch.int8 and packed.shape == (c.hidden_size, c.moe_intermediate_size // 2)
    e = formats.dequantize_mxfp4(packed, ckpt.tensor("layers.3.ffn.experts.5.w2.scale"), torch.float32)
    assert torch.isfinite(e).all() and 0.02 < e.std() * c.moe_intermediate_size**0.5 < 2
    tid2eid = ckpt.tensor("layers.0.ffn.gate.tid2eid")
    assert tid2eid.shape == (c.vocab_size, c.num_experts_per_tok)
    assert all(len(set(row.tolist())) == c.num_experts_per_tok for row in tid2eid[:50])
    assert int(tid2eid.min()) >= 0 and int(tid2eid.max()) < c.n_routed_experts


def test_synthetic_checkpoint_is_deterministic_by_seed(tmp_path, tiny_dir):
    again = write_synthetic_checkpoint(preset("tiny", num_hidden_layers=2), tmp_path / "a",
                                       seed=7, progress=False)
    other = write_synthetic_checkpoint(preset("tiny", num_hidden_layers=2), tmp_path / "b",
                                       seed=8, progress=False)
    name = "layers.1.attn.wkv.weight"
    same = Checkpoint(tiny_dir).tensor(name).view(torch.uint8)
    assert torch.equal(Checkpoint(again).tensor(name).view(torch.uint8), same)
    assert not torch.equal(Checkpoint(other).tensor(name).view(torch.uint8), same)


def test_refuses_to_overwrite(tiny_dir):
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        write_synthetic_checkpoint(preset("tiny"), tiny_dir, progress=False)


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import monodecode.checkpoint as module

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(module, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        write_synthetic_checkpoint(preset("tiny"), tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_single_file_with_transformers_names(tmp_path, tiny_dir):
    """transformers' save_pretrained writes `model.`-prefixed names with a few renames."""
    ckpt = Checkpoint(tiny_dir)
    renamed = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
               "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
               "hc_head_scale": "model.hc_head.hc_scale",
               "layers.2.attn.kv_norm.weight": "model.layers.2.attn.norm.weight"}
    tensors = {}
    for name in ckpt._where:
        if not name.startswith("mtp."):
            tensors[renamed.get(name, "model." + name)] = ckpt.tensor(name)
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    single = Checkpoint(tmp_path)
    single.validate()
    assert not single.has_draft
    assert torch.equal(single.tensor("layers.2.attn.kv_norm.weight"),
                       ckpt.tensor("layers.2.attn.kv_norm.weight"))
    with pytest.raises(CheckpointError, match="DSpark draft tensor mtp.0.main_proj.weight is missing"):
        single.validate(require_draft=True)


def test_canonical_names():
    assert canonical_name("model.layers.3.attn.norm.weight") == "layers.3.attn.kv_norm.weight"
    assert canonical_name("model.layers.3.attn.compressor.norm.weight") == "layers.3.attn.compressor.norm.weight"
    assert canonical_name("layers.3.attn.kv_norm.weight") == "layers.3.attn.kv_norm.weight"
    assert canonical_name("model.norm.weight") == "norm.weight"
    assert canonical_name("mtp.2.attn.norm.weight") == "mtp.2.attn.kv_norm.weight"


def rewrite_shard(directory, name, change):
    """Rewrite the shard holding `name` with change(tensors) applied."""
    index = json.loads((directory / INDEX_FILE).read_text())
    file = directory / index["weight_map"][name]
    with safe_open(file, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, file)
    return file.name


def test_missing_tensor_is_named(tmp_path, tiny_dir):
    d = copy_of(tiny_dir, tmp_path)
    rewrite_shard(d, "layers.1.attn.wq_a.scale", lambda t: t.pop("layers.1.attn.wq_a.scale"))
    with pytest.raises(CheckpointError, match="tensor layers.1.attn.wq_a.scale is missing"):
        Checkpoint(d).validate()


def test_unexpected_tensor_is_named(tmp_path, tiny_dir):
    d = copy_of(tiny_dir, tmp_path)
    file = rewrite_shard(d, "layers.1.attn.wq_a.scale",
                         lambda t: t.update({"layers.1.attn.bogus": torch.ones(3)}))
    with pytest.raises(CheckpointError, match=f"unexpected tensor layers.1.attn.bogus in {file}"):
        Checkpoint(d).validate()


def test_wrong_shape_names_expected_and_found(tmp_path, tiny_dir):
    d = copy_of(tiny_dir, tmp_path)
    name = "layers.2.attn.wo_b.weight"
    file = rewrite_shard(d, name, lambda t: t.update({name: t[name][:-1].contiguous()}))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(d).validate()
    assert f"tensor {name} in {file} has shape [127, 64], expected [128, 64]" in str(e.value)


def test_wrong_dtype_names_expected_and_found(tmp_path, tiny_dir):
    d = copy_of(tiny_dir, tmp_path)
    name = "layers.3.ffn.experts.1.w1.scale"
    file = rewrite_shard(d, name, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(d).validate()
    assert f"tensor {name} in {file} has dtype float32, expected float8_e8m0fnu" in str(e.value)


def test_truncated_file_is_named(tmp_path, tiny_dir):
    d = copy_of(tiny_dir, tmp_path)
    file = d / json.loads((d / INDEX_FILE).read_text())["weight_map"]["layers.2.attn.wq_a.weight"]
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{file.name} is not a readable safetensors file"):
        Checkpoint(d)


def test_index_naming_a_missing_shard(tmp_path, tiny_dir):
    d = copy_of(tiny_dir, tmp_path)
    shard = json.loads((d / INDEX_FILE).read_text())["weight_map"]["head.weight"]
    (d / shard).unlink()
    with pytest.raises(CheckpointError, match=f"lists {shard}, which does not exist"):
        Checkpoint(d)


def test_duplicate_tensor_across_shards(tmp_path, tiny_dir):
    d = copy_of(tiny_dir, tmp_path)
    save_file({"model.embed.weight": torch.ones(2)}, d / "extra.safetensors")
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"]["model.embed.weight"] = "extra.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="embed.weight appears twice"):
        Checkpoint(d)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_dict()))
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        Checkpoint(tmp_path)


def test_tensors_iterates_requested_names(tiny_dir):
    ckpt = Checkpoint(tiny_dir)
    names = ["head.weight", "layers.0.attn.wq_a.weight", "mtp.2.norm.weight"]
    got = dict(ckpt.tensors(names))
    assert set(got) == set(names)
    assert torch.equal(got["head.weight"], ckpt.tensor("head.weight"))
    with pytest.raises(CheckpointError, match="tensor nope is missing"):
        list(ckpt.tensors(["nope"]))


def test_synthetic_tensors_do_not_depend_on_order_or_threads(tiny_dir):
    """SyntheticCheckpoint.tensors makes tensors ahead in threads: in any order it yields the
    tensors the written checkpoint holds, and a missing name is refused before any is made."""
    written, synthetic = Checkpoint(tiny_dir), SyntheticCheckpoint(preset("tiny"), seed=7)
    names = [n for spec in synthetic.specs for n in spec.stored()]
    reordered = names[::2] + names[1::2][::-1]  # a spec's tensors apart, and reversed
    got = list(synthetic.tensors(reordered))
    assert [name for name, _ in got] == reordered
    for name, tensor in got:
        assert torch.equal(tensor.view(torch.uint8), written.tensor(name).view(torch.uint8)), name
    made = []
    with pytest.raises(CheckpointError, match="tensor nope is missing"):
        made.extend(synthetic.tensors(names[:3] + ["nope"]))
    assert made == []


def test_every_tensor_read_is_16_byte_aligned_for_the_kernels(tiny_dir):
    """safetensors puts tensors back to back, so a memory-mapped one starts at any byte; the
    reader copies those not 16-byte aligned, and a written checkpoint passes the mono kernels'
    weight check (the in-memory synthetic checkpoint the other tests use hid this)."""
    ckpt = Checkpoint(tiny_dir)
    names = list(ckpt._where)
    assert all(tensor.data_ptr() % 16 == 0 for _, tensor in ckpt.tensors(names))
    assert all(ckpt.tensor(name).data_ptr() % 16 == 0 for name in names)
    model = monodecode.load(tiny_dir, dtype=torch.bfloat16, mono="on")  # on the CPU: Triton's interpreter
    assert model.mono is not None
