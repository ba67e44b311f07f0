"""DeepSeek-V4.1's Engram (model/engram.py): the multipliers and bucket ranges against the released
values, the hash against plain-int arithmetic, the sequence-start pad, the gather and wkv layouts,
the gate against a per-(token, stream) loop, and the token map from a tokenizer.json."""

import math
import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from monodecode.checkpoint import SyntheticCheckpoint
from monodecode.config import ConfigError, preset
from monodecode.model.engram import (Engram, compressed_token_map, gated_update, hash_buckets, hash_multipliers,
                                     hash_rows, ngram_ids)
from monodecode.model.weights import read_weights

TINY = preset("tiny-v4.1")  # Engram layers 0 and 3; 3-grams, 2 heads, rows 32 wide, 300 classes
PREFIX = "layers.0.engram."
# tiny-v4.1's bucket primes (engram_vocab_size 61): the primes from 61 up, order-major per layer.
TINY_PRIMES = ((61, 67, 71, 73), (79, 83, 89, 97))


@pytest.fixture(scope="module")
def weights():
    return read_weights(SyntheticCheckpoint(TINY, seed=random.randrange(1000)), "model", "cpu", torch.float32)


def reference_rows(ngram, multipliers, primes, pad, heads):
    """One n-gram's rows with Python ints, step by step as DeepSeek-V4.1's reference hashes."""
    rows, rolling, blocked, start = [], 0, False, 0
    for s, value in enumerate(ngram):
        blocked = blocked or value < 0
        rolling ^= (pad if blocked else value) * multipliers[s]
        if s:
            for head in range(heads):
                prime = primes[(s - 1) * heads + head]
                rows.append(rolling % prime + start)
                start += prime
    return rows


def tiny_multipliers(layer):
    bound = (2**63 - 1) // TINY.engram_compressed_vocab_size // 2
    return [2 * int(v) + 1 for v in np.random.default_rng(10007 * layer).integers(0, bound, size=3, dtype=np.int64)]


def random_ngrams(n, classes, width=3):
    """[n, width] random classes, each row cut at a random sequence start (-1 from there on)."""
    ngrams = torch.randint(0, classes, (n, width))
    starts = torch.randint(1, width + 2, (n, 1))  # a start past the last slot: no -1
    return torch.where(torch.arange(width) >= starts, -1, ngrams)


# --- multipliers, bucket ranges ---------------------------------------------------------------------
def test_v41_flash_multipliers_are_the_released_ones():
    assert hash_multipliers(preset("v4.1-flash")).tolist() == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591]]


def test_v41_flash_bucket_ranges_tile_each_table():
    c = preset("v4.1-flash")
    for slot, last_offset in enumerate((368005705, 368015793)):
        primes, offsets = hash_buckets(c, slot)
        assert offsets[0] == 0 and offsets[-1] == last_offset
        assert offsets[-1] + primes[-1] == c.engram_num_embeddings[slot]
        ngrams = random_ngrams(4096, c.engram_compressed_vocab_size, width=4)
        rows = hash_rows(c, slot, ngrams, pad_id=random.randrange(c.engram_compressed_vocab_size))
        assert rows.dtype == torch.int64 and rows.shape == (4096, 24)
        assert ((rows >= offsets) & (rows < offsets + primes)).all()  # each column in its own range
    assert hash_buckets(c, 0)[0][0] == 16000057 and hash_buckets(c, 1)[0][-1] == 16000889


# --- the hash ---------------------------------------------------------------------------------------
def test_hash_matches_plain_int_arithmetic():
    pad = 2
    c0, c1, c2 = (random.randrange(300) for _ in range(3))
    m0, m1, m2 = tiny_multipliers(0)  # layer 0: seed 0
    by_hand = [(c0 * m0 ^ c1 * m1) % 61, (c0 * m0 ^ c1 * m1) % 67 + 61,
               (c0 * m0 ^ c1 * m1 ^ c2 * m2) % 71 + 61 + 67, (c0 * m0 ^ c1 * m1 ^ c2 * m2) % 73 + 61 + 67 + 71]
    assert hash_rows(TINY, 0, torch.tensor([[c0, c1, c2]]), pad).tolist() == [by_hand]
    for slot, layer in enumerate(TINY.engram_layer_ids):
        ngrams = random_ngrams(64, 300)
        expected = [reference_rows(g, tiny_multipliers(layer), TINY_PRIMES[slot], pad, 2) for g in ngrams.tolist()]
        assert hash_rows(TINY, slot, ngrams, pad).tolist() == expected


def test_sequence_start_is_padded_and_a_literal_pad_token_is_not():
    token_map = compressed_token_map(TINY)
    pad = int(token_map[TINY.engram_pad_token_id])
    text = [t for t in torch.randint(3, TINY.vocab_size, (3,)).tolist()]
    c = [int(token_map[t]) for t in text]
    history = torch.tensor([[-1, -1], [text[0], -1], [text[1], text[0]]])
    ngrams = ngram_ids(token_map, torch.tensor(text), history)
    assert ngrams.tolist() == [[c[0], -1, -1], [c[1], c[0], -1], [c[2], c[1], c[0]]]

    def rows(ngram):
        return hash_rows(TINY, 0, torch.tensor([ngram]), pad)[0].tolist()

    assert hash_rows(TINY, 0, ngrams, pad).tolist() == [rows([c[0], pad, pad]), rows([c[1], c[0], pad]),
                                                        rows([c[2], c[1], c[0]])]
    # Sticky: a slot past one before the start is padded whatever it holds.
    far = next(x for x in range(3, 300) if rows([c[0], pad, x])[2:] != rows([c[0], pad, pad])[2:])
    assert rows([c[0], -1, far]) == rows([c[0], pad, pad])
    # The pad token inside the text is an ordinary token: the slots behind it keep their tokens.
    inside = ngram_ids(token_map, torch.tensor([text[0]]), torch.tensor([[TINY.engram_pad_token_id, far]]))
    assert inside.tolist() == [[c[0], pad, far]]
    assert hash_rows(TINY, 0, inside, pad)[0].tolist() == rows([c[0], pad, far]) != rows([c[0], pad, pad])


# --- gather, wkv ------------------------------------------------------------------------------------
def engram_with_table(table, hc_d=(TINY.hc_mult, TINY.hidden_size)):
    """Engram layer 0 of tiny-v4.1 over `table` (a tuple as read_weights keeps it), random dense weights."""
    hc, d = hc_d
    width = TINY.engram_hash_columns * TINY.engram_head_dim
    w = {f"{PREFIX}embed": table, f"{PREFIX}wkv": torch.randn(d * (hc + 1), width) * 0.1,
         f"{PREFIX}q_weight": torch.rand(hc, d) + 0.5, f"{PREFIX}k_weight": torch.rand(hc, d) + 0.5}
    return Engram(TINY, w, PREFIX, 0, compressed_token_map(TINY))


def random_rows(n, slot=0):
    primes, offsets = hash_buckets(TINY, slot)
    return offsets + (torch.rand(n, len(primes)) * primes).long()


def test_gather_puts_each_tokens_rows_side_by_side():
    rows_total, width = TINY.engram_num_embeddings[0], TINY.engram_head_dim
    table = torch.arange(rows_total * width, dtype=torch.float32).view(rows_total, width)  # value = row * width + d
    rows = random_rows(5)
    features = engram_with_table((table,)).gather(rows)
    assert features.shape == (5, TINY.engram_hash_columns * width)
    for n in range(5):
        for col in range(TINY.engram_hash_columns):
            for d in (0, 7, width - 1):
                assert features[n, col * width + d] == rows[n, col] * width + d


def test_gather_dequantizes_the_stored_rows(weights):
    codes, scale = weights[f"{PREFIX}embed"]
    rows = random_rows(6)
    features = Engram(TINY, weights, PREFIX, 0, compressed_token_map(TINY)).gather(rows)
    assert features.dtype == torch.float32
    width = TINY.engram_head_dim
    for n in range(6):
        for col in range(TINY.engram_hash_columns):
            r = int(rows[n, col])
            expected = codes[r].float() * scale[r].float().repeat_interleave(32)  # e8m0 -> 2 ** (byte - 127)
            assert torch.equal(features[n, col * width:(col + 1) * width], expected)


def test_wkv_gives_the_stream_keys_then_the_value():
    engram = engram_with_table((torch.randn(TINY.engram_num_embeddings[0], TINY.engram_head_dim),))
    features = torch.randn(3, engram.wkv.shape[1])
    keys, value = engram.project(features)
    d = TINY.hidden_size
    for j in range(TINY.hc_mult):
        torch.testing.assert_close(keys[:, j], features @ engram.wkv[j * d:(j + 1) * d].T)
    torch.testing.assert_close(value, features @ engram.wkv[TINY.hc_mult * d:].T)


# --- the gate ---------------------------------------------------------------------------------------
def loop_reference(streams, kv, gate_weight, eps):
    """The gated update one (token, stream) at a time, in float64."""
    n_rows, hc, d = streams.shape
    out = torch.empty_like(streams, dtype=torch.float64)
    for n in range(n_rows):
        value = kv[n, hc * d:].double()
        for j in range(hc):
            h, key = streams[n, j].double(), kv[n, j * d:(j + 1) * d].double()
            rms_h, rms_key = math.sqrt(h.square().mean() + eps), math.sqrt(key.square().mean() + eps)
            dot = float((h * gate_weight[j].double() * key).sum()) / (rms_h * rms_key * math.sqrt(d))
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            out[n, j] = h + gate * value
    return out


def test_engram_matches_a_loop_reference(weights):
    token_map = (compressed_token_map(TINY) + 1) % 300  # the pad token's class is 3, not its id 2
    engram = Engram(TINY, weights, PREFIX, 0, token_map)
    n, hc, d = 12, TINY.hc_mult, TINY.hidden_size
    streams = torch.randn(n, hc, d)
    streams[0, 1] = 0  # a zero stream: eps (1e-20) keeps its norm finite, the floor sets its gate
    streams[1, 2] *= 1e-4  # a tiny stream, whose norm an eps of 1e-6 would change
    ngrams = random_ngrams(n, 300)
    out = engram(streams, ngrams)
    assert out.dtype == streams.dtype and out.shape == streams.shape

    codes, scale = weights[f"{PREFIX}embed"]
    rows = hash_rows(TINY, 0, ngrams, pad_id=3)
    features = torch.stack([torch.cat([codes[r].float() * scale[r].float().repeat_interleave(32) for r in row])
                            for row in rows.tolist()])
    kv = features @ weights[f"{PREFIX}wkv"].T
    gate_weight = weights[f"{PREFIX}q_weight"] * weights[f"{PREFIX}k_weight"]
    expected = loop_reference(streams, kv, gate_weight, TINY.rms_norm_eps)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0, 1], kv[0, hc * d:] / (1 + math.exp(-1e-3)))  # gate sigmoid(sqrt(1e-6))


@pytest.mark.parametrize("sign", [-1, 1])
def test_forced_gate_scales_the_value(sign):
    """A table of ones makes every token's keys and value the same; streams aligned with the keys and
    a large gate weight of sign `sign` force the gate to ~0 (streams barely move) or ~1 (value added)."""
    rows_total = TINY.engram_num_embeddings[0]
    engram = engram_with_table((torch.ones(rows_total, TINY.engram_head_dim),))
    keys, value = engram.project(torch.ones(1, engram.wkv.shape[1]))
    engram.gate_weight = torch.full_like(engram.gate_weight, 20.0 * sign)
    streams = keys.sign() * (torch.rand(8, TINY.hc_mult, TINY.hidden_size) + 0.1)
    change = engram(streams, random_ngrams(8, 300)) - streams
    if sign < 0:
        assert 0 < change.abs().max() < 1e-4 * value.abs().max()
    else:
        torch.testing.assert_close(change, value.expand_as(change), rtol=1e-4, atol=1e-4 * value.abs().max())


def test_rows_are_independent(weights):
    engram = Engram(TINY, weights, PREFIX, 0, compressed_token_map(TINY))
    streams, ngrams = torch.randn(6, TINY.hc_mult, TINY.hidden_size), random_ngrams(6, 300)
    out = engram(streams, ngrams)
    other_streams, other_ngrams = streams.clone(), ngrams.clone()
    other_streams[2] = torch.randn(TINY.hc_mult, TINY.hidden_size)
    other_ngrams[2] = (ngrams[2] + 1) % 300  # other classes, and no slot before the start
    other = engram(other_streams, other_ngrams)
    assert not torch.equal(other[2], out[2])
    assert torch.equal(torch.cat([other[:2], other[3:]]), torch.cat([out[:2], out[3:]]))


def test_gated_update_rounds_once_to_the_streams_dtype():
    """Streams of 1.0 in bf16 (next value 1 + 2**-7) plus an update just over half that step: one
    rounding of the fp32 sum goes up; rounding the update to bf16 first (exactly half) would tie to 1.0."""
    streams = torch.ones(3, 2, 64, dtype=torch.bfloat16)
    gate = torch.sigmoid(torch.tensor(1e-3))  # zero keys: dot 0, the gate at its floor sqrt(1e-6)
    value = torch.full((3, 64), 2.0**-8 * 1.0001) / gate
    out = gated_update(streams, torch.zeros(3, 2, 64), value, torch.ones(2, 64), 1e-20)
    assert out.dtype == torch.bfloat16
    assert (out == 1 + 2.0**-7).all()


# --- the token map ----------------------------------------------------------------------------------
def byte_level(text):
    """`text` as a byte-level BPE vocabulary spells it (one printable character a byte)."""
    return "".join(p for p, _ in pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
                   .pre_tokenize_str(text))


# (vocab entry, expected class): merged by case, leading space, accents and whitespace runs; a lone
# UTF-8 lead byte decodes to U+FFFD and keys by its vocab string (so 0xC3 and 0xC4 differ); a lone
# combining accent normalises to nothing and keys by its own text; classes count in order of first
# appearance.
VOCAB = [(byte_level(text), cls) for text, cls in [
    ("<s>", 0), ("</s>", 1), ("<pad>", 2), ("Hello", 3), ("hello", 3), ("HELLO", 3), (" hello", 3),
    ("café", 4), ("cafe", 4), ("\t", 5), (" ", 5), ("  ", 5)]]
VOCAB += [(byte_level("é")[0], 6), (byte_level("ę")[0], 7)]
VOCAB += [(byte_level(text), cls) for text, cls in [("\u0301", 8), ("\u0300", 9), ("World", 10)]]


@pytest.fixture
def tokenizer_json(tmp_path):
    vocab = {entry: i for i, (entry, _) in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>", "<pad>"])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_token_map_merges_what_normalises_alike(tokenizer_json):
    config = preset("tiny-v4.1", vocab_size=20, engram_compressed_vocab_size=11, dspark_noise_token_id=19)
    token_map = compressed_token_map(config, tokenizer_json)
    # ids 17..19 are past the tokenizer: a class each, after its 11
    assert token_map.tolist() == [cls for _, cls in VOCAB] + [11, 12, 13]
    primes, offsets = hash_buckets(config, 0)
    ngrams = torch.tensor([[13, 12, 11], [11, 13, 13], [5, 13, -1]])  # classes past the compressed vocab
    rows = hash_rows(config, 0, ngrams, pad_id=int(token_map[2]))
    assert ((rows >= offsets) & (rows < offsets + primes)).all()


def test_token_map_refuses_a_wrong_class_count(tokenizer_json):
    config = preset("tiny-v4.1", vocab_size=20, engram_compressed_vocab_size=12, dspark_noise_token_id=19)
    with pytest.raises(ConfigError, match="11 classes.*engram_compressed_vocab_size is 12"):
        compressed_token_map(config, tokenizer_json)


def test_stand_in_token_map_without_a_tokenizer():
    token_map = compressed_token_map(TINY)
    assert token_map.dtype == torch.int64
    assert token_map.tolist() == [i % 300 for i in range(TINY.vocab_size)]
    assert len(set(token_map.tolist())) == TINY.engram_compressed_vocab_size
