"""DeepSeek-V4.1 checkpoints: the tensor table, the synthetic writer and the loader's checks, 32 x 32
(and Engram 1 x 32) FP8 blocks, `inspect`, and the refusals of what cannot run V4.1 yet."""

import json
import math
import re

import pytest
import torch

from monodecode import formats, v41
from monodecode.checkpoint import INDEX_FILE, Checkpoint, CheckpointError, SyntheticCheckpoint, write_synthetic_checkpoint
from monodecode.cli import main
from monodecode.config import preset
from monodecode.mono.plan import refusals
from monodecode.schema import tensor_specs

from test_checkpoint import copy_of, rewrite_shard  # tests/ is on the path (rootdir conftest)


@pytest.fixture(scope="module")
def tiny41_dir(tmp_path_factory):
    return write_synthetic_checkpoint(preset("tiny-v4.1"), tmp_path_factory.mktemp("ckpt41") / "tiny41",
                                      seed=11, progress=False)


def stored_names(config):
    return {n for s in tensor_specs(config) for n in s.stored()}


# --- the tensor table -----------------------------------------------------------------------------
def layers_holding(names, suffix):
    return sorted({int(m.group(1)) for n in names if (m := re.match(rf"layers\.(\d+)\.{re.escape(suffix)}$", n))})


def test_tensor_table_follows_the_source_maps():
    c = preset("v4.1-flash")
    names = stored_names(c)
    assert layers_holding(names, "attn.wq_a.weight") == list(range(40))
    assert layers_holding(names, "attn.wkv.weight") == list(range(40))  # every layer's own window KV
    assert layers_holding(names, "attn.compressor.wkv.weight") == [2, 8, 14, 20]
    assert layers_holding(names, "attn.compressor.wgate.weight") == [2, 8, 14]  # ratio 1 pools nothing
    assert layers_holding(names, "attn.indexer.wk.weight") == [2, 8, 14, 20]
    assert layers_holding(names, "attn.indexer.wq_b.weight") == [2, 8, 14, 20, 24, 28, 32, 36]
    assert layers_holding(names, "engram.embed.weight") == [1, 14]
    assert layers_holding(names, "ffn.gate.bias_vl") == list(range(40))
    assert not any("tid2eid" in n or "hc_head" in n for n in names)
    assert {"mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight"} <= names
    experts = [n for n in names if re.match(r"mtp\.\d+\.ffn\.experts\.\d+\.w1\.weight$", n)]
    assert len(experts) == 3 * 128


def test_engram_shapes_and_blocks():
    c = preset("v4.1-flash")
    specs = {s.name: s for s in tensor_specs(c)}
    table = specs["layers.14.engram.embed"]
    assert table.shape == (384016682, 256) and table.fmt == "fp8" and table.fp8_block == (1, 32)
    assert table.stored()["layers.14.engram.embed.scale"][0] == (384016682, 8)
    assert specs["layers.1.engram.wkv"].shape == (5120 * 5, 24 * 256)
    assert specs["layers.1.engram.q_weight"].shape == (4, 5120)
    assert specs["layers.2.attn.wq_b"].stored()["layers.2.attn.wq_b.scale"][0] == (32768 // 32, 1280 // 32)
    # the whole text checkpoint: ~196 G Engram rows dominate, as published (475 GiB with the vision tower)
    total = sum(s.nbytes() for s in tensor_specs(c))
    assert 470 * 2**30 < total < 476 * 2**30


def test_v4_tensor_tables_have_no_v41_tensors():
    for name in ("tiny", "v4-flash"):
        names = stored_names(preset(name))
        assert not any("engram" in n or "bias_vl" in n or "indexer.wk" in n for n in names)
        assert "hc_head_fn" in names


# --- writer and loader -----------------------------------------------------------------------------
def test_synthetic_v41_checkpoint_round_trips(tiny41_dir):
    ckpt = Checkpoint(tiny41_dir)
    assert ckpt.config == preset("tiny-v4.1")
    ckpt.validate(require_draft=True)
    assert set(ckpt._where) == stored_names(ckpt.config)
    index = json.loads((tiny41_dir / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) == 1 + 7 + 3  # top level, a shard a layer, a draft stage
    # what the loader reads is what the writer generated, bit for bit
    synthetic = SyntheticCheckpoint(ckpt.config, seed=11)
    for name in ("layers.3.engram.embed.weight", "layers.3.engram.embed.scale", "layers.4.attn.indexer.wk.weight",
                 "layers.1.attn.compressor.wgate.weight", "layers.6.ffn.experts.7.w2.weight", "mtp.2.markov_head.head.weight"):
        a, b = ckpt.tensor(name), synthetic.tensor(name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_synthetic_v41_tensors_are_usable(tiny41_dir):
    ckpt = Checkpoint(tiny41_dir)
    c = ckpt.config
    q, s = ckpt.tensor("layers.0.engram.embed.weight"), ckpt.tensor("layers.0.engram.embed.scale")
    assert q.shape == (272, 32) and s.shape == (272, 1) and s.dtype == torch.float8_e8m0fnu
    rows = formats.dequantize_fp8_block(q, s, (1, 32), torch.float32)
    assert torch.isfinite(rows).all() and rows.std() > 0
    w = formats.dequantize_fp8_block(ckpt.tensor("layers.0.engram.wkv.weight"), ckpt.tensor("layers.0.engram.wkv.scale"),
                                     c.fp8_block, torch.float32)
    assert w.shape == (128 * 5, 4 * 32) and 0.02 < float(w.std()) * w.shape[1] ** 0.5 < 2
    qw = ckpt.tensor("layers.3.engram.q_weight").float()
    assert qw.shape == (4, 128) and 0.7 < float(qw.mean()) < 1.3


def test_make_checkpoint_cli_writes_tiny_v41(tmp_path, capsys):
    out = tmp_path / "t41"
    assert main(["make-checkpoint", "--preset", "tiny-v4.1", "--layers", "5", "--out", str(out)]) == 0
    ckpt = Checkpoint(out)
    ckpt.validate(require_draft=True)
    assert ckpt.config == preset("tiny-v4.1", num_hidden_layers=5)
    assert ckpt.config.index_source_layer_ids == (1, 3, 4) and ckpt.config.dspark_target_layer_ids == (2, 3, 4)


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("layers.3.engram.embed.weight", lambda t, n: t.update({n: t[n][:-1].contiguous()}),
         "tensor layers.3.engram.embed.weight in {file} has shape [347, 32], expected [348, 32]"),
        ("layers.3.engram.embed.scale", lambda t, n: t.update({n: t[n].float()}),
         "tensor layers.3.engram.embed.scale in {file} has dtype float32, expected float8_e8m0fnu"),
        ("layers.1.attn.compressor.wkv.weight", lambda t, n: t.update({n: t[n][:, :64].contiguous()}),
         "tensor layers.1.attn.compressor.wkv.weight in {file} has shape [64, 64], expected [64, 128]"),
        ("layers.4.attn.indexer.wk.weight", lambda t, n: t.pop(n), "tensor layers.4.attn.indexer.wk.weight is missing"),
        ("layers.2.attn.wq_a.weight",  # a V4-style compressor on a layer that reads layer 1's
         lambda t, n: t.update({"layers.2.attn.compressor.wkv.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}),
         "unexpected tensor layers.2.attn.compressor.wkv.weight in {file} (not in the DeepSeek-V4.1 layout"),
        ("layers.0.attn.wq_a.weight", lambda t, n: t.update({"layers.0.hc_head_fn": torch.zeros(4, 512)}),
         "unexpected tensor layers.0.hc_head_fn"),
        ("mtp.2.markov_head.embed.weight", lambda t, n: t.pop(n),
         "the DSpark draft tensor mtp.2.markov_head.embed.weight is missing"),
    ],
)
def test_loader_checks_name_the_tensor(tmp_path, tiny41_dir, name, change, message):
    d = copy_of(tiny41_dir, tmp_path)
    file = rewrite_shard(d, name, lambda t: change(t, name))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(d).validate(require_draft=name.startswith("mtp."))
    assert message.format(file=file) in str(e.value)


def test_vision_tower_tensors_are_left_unread(tmp_path, tiny41_dir):
    d = copy_of(tiny41_dir, tmp_path)
    extra = {"vision.blocks.0.attn.wqkv.weight": torch.zeros(8, 8), "aligner.proj.weight": torch.zeros(4, 8)}
    rewrite_shard(d, "embed.weight", lambda t: t.update(extra))
    Checkpoint(d).validate()  # the text model only: the vision part is not an error, and not read
    # a V4 checkpoint has no vision part: there they are unexpected
    v4 = write_synthetic_checkpoint(preset("tiny", num_hidden_layers=1), tmp_path / "v4", progress=False)
    rewrite_shard(v4, "embed.weight", lambda t: t.update(extra))
    with pytest.raises(CheckpointError, match="unexpected tensor (vision|aligner)"):
        Checkpoint(v4).validate()


# --- 32 x 32 FP8 blocks --------------------------------------------------------------------------------
def reference_fp8_block(w, block):
    """The UE8M0 block rule, one block at a time: scale 2^ceil(log2(max(amax, 1e-4) / 448))."""
    b0, b1 = block
    rows, cols = w.shape
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    codes = torch.empty(math.ceil(rows / b0), math.ceil(cols / b1), dtype=torch.uint8)
    for i in range(codes.shape[0]):
        for j in range(codes.shape[1]):
            tile = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float()
            exponent = math.ceil(math.log2(max(float(tile.abs().max()), 1e-4) / 448))
            codes[i, j] = exponent + 127
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (tile / 2.0**exponent).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, codes.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("shape, block", [((96, 64), (32, 32)), ((70, 100), (32, 32)), ((9, 96), (1, 32))])
def test_fp8_blocks_quantize_exactly(shape, block):
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    # per-block magnitudes over many binades, so that the blocks' scales differ
    w = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-12, 12, (shape[0] // block[0] + 1, 1), generator=g
                                                                ).repeat_interleave(block[0], 0)[: shape[0]]
    q, scale = formats.quantize_fp8_block(w, block)
    ref_q, ref_scale = reference_fp8_block(w, block)
    assert scale.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))
    assert len(set(scale.view(torch.uint8).flatten().tolist())) > 1
    deq = formats.dequantize_fp8_block(q, scale, block, torch.float32)
    expand = formats.e8m0_to_float(scale).repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
    assert torch.equal(deq, q.float() * expand)
    # values already on the grid come back unchanged: a second pass is exact
    q2, scale2 = formats.quantize_fp8_block(deq, block)
    assert torch.equal(formats.dequantize_fp8_block(q2, scale2, block, torch.float32), deq)
    assert float((deq - w).abs().max()) <= float(w.abs().max()) / 8  # within e4m3's 3 mantissa bits


def test_fp8_32_blocks_are_independent():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    q, scale = formats.quantize_fp8_block(w, (32, 32))
    w2 = w.clone()
    w2[32:, :32] *= 1024  # one block only
    q2, scale2 = formats.quantize_fp8_block(w2, (32, 32))
    changed = scale2.view(torch.uint8).int() - scale.view(torch.uint8).int()
    assert changed.tolist() == [[0, 0], [10, 0]]
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))  # the codes scale with the block
    with pytest.raises(ValueError, match=r"expected \(2, 2\) for q \(64, 64\) and block \(32, 32\), found \(1, 1\)"):
        formats.dequantize_fp8_block(q, formats.quantize_fp8_block(w, (128, 128))[1], (32, 32))


# --- inspect ---------------------------------------------------------------------------------------------
def layer_table(out):
    """{layer: (kind, ratio, KV from, index from, notes)} of inspect's V4.1 layer table."""
    rows = {}
    for line in out.split("layers\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]:
        parts = line.split(None, 5)
        rows[int(parts[0])] = (parts[1], int(parts[2]), parts[3], parts[4], parts[5] if len(parts) > 5 else "")
    return rows


def test_inspect_v41_flash(capsys):
    assert main(["inspect", "v4.1-flash"]) == 0
    out = capsys.readouterr().out
    assert "KV computed on layers [2, 8, 14, 20], indexers on layers [2, 8, 14, 20, 24, 28, 32, 36]" in out
    assert "candidates: layer 20 publishes 2048 blocks of 8 positions; the indexers of layers [24, 28, 32, 36]" in out
    assert "Engram on layers [1, 14]: tables of [384006168, 384016682] rows x 256, 24 rows a token" in out
    assert "no hc_head" in out and "norm eps 1e-20" in out and "UE8M0 per 32x32" in out
    assert "hash-routed layers: none" in out and "128 experts top-3 (reads the stream entering" in out
    table = layer_table(out)
    assert sorted(table) == list(range(40))
    c = preset("v4.1-flash")
    for i, (kind, ratio, kv, index, notes) in table.items():
        show = lambda s: "-" if s is None else "itself" if s == i else str(s)  # noqa: E731
        assert (kind, ratio, kv, index) == (c.layer_kinds[i], c.compress_ratios[i], show(c.kv_source_of(i)),
                                            show(c.index_source_of(i))), i
        assert ("Engram" in notes) == (i in (1, 14))
        assert ("candidate" in notes) == (i in (20, 24, 28, 32, 36))
    assert table[25][2:4] == ("20", "24")
    # step bytes by layer role: Engram layers read their 24 table rows and the 150 MiB wkv on top
    lines = {line.split("  ")[1].strip(): line for line in out.splitlines() if "e.g. layer" in line}
    assert set(lines) == {"window", "window + Engram", "csa r2 KV+index source", "csa r2 reads both",
                          "csa r2 KV+index source + Engram", "csa r1 KV+index source", "csa r1 reads both",
                          "csa r1 index source"}
    assert "107.58 MiB" in lines["window"]  # six 17.93 MiB experts (3 x 2304 x 5120 FP4 + scales)
    assert "whole target model" in out


def test_inspect_reads_a_v41_checkpoint(tiny41_dir, capsys):
    assert main(["inspect", str(tiny41_dir)]) == 0
    out = capsys.readouterr().out
    assert "(all tensors checked)" in out and "Engram on layers [0, 3]" in out
    table = layer_table(out)
    assert table[6] == ("csa", 1, "4", "itself", "indexer inside layer 4's candidates")
    assert table[2][2:4] == ("1", "1") and table[4][4] == "publishes 4 candidate blocks"


# --- refusals ---------------------------------------------------------------------------------------------
def test_bench_layer_refuses_v41_by_name():
    from monodecode.bench.layer import build

    with pytest.raises(v41.NotBuilt, match=r"`bench layer` \(it times V4's window, CSA and HCA layers\) is not built"):
        build("tiny-v4.1", "cpu")


def test_mono_kernels_refuse_v41_naming_the_block_case():
    reasons = refusals(preset("tiny-v4.1"), torch.device("cpu"), torch.bfloat16, interpreter=True)
    assert len(reasons) == 1
    assert "DeepSeek-V4.1 is not built in the kernels" in reasons[0] and "32x32" in reasons[0]
    assert refusals(preset("tiny"), torch.device("cpu"), torch.bfloat16, interpreter=True) == []  # 32x32 V4 runs


def test_writer_refuses_a_table_too_large_to_draw(tmp_path, monkeypatch, capsys):
    import monodecode.model.weights

    monkeypatch.setattr(monodecode.model.weights, "free_memory", lambda device: 64 * 2**30)
    out = tmp_path / "big"
    assert main(["make-checkpoint", "--preset", "v4.1-flash", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "tensor layers.14.engram.embed [384016682, 256] needs about 732 GiB" in err and "64 GiB is free" in err
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written
