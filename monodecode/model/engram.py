"""DeepSeek-V4.1's Engram: a hashed n-gram memory, gated into the hc streams.

Each token looks up the n-grams that end at it (2 .. engram_max_ngram_size tokens) in its layer's
table. Tokens are first merged into classes (the compressed vocabulary: tokens whose text
normalises alike share a class). Each n-gram order hashes into `engram_n_heads` buckets, one
bucket range a head, so a token reads one table row per hash column. Its rows, side by side, go
through `wkv` to one key per hc stream and one value shared by the streams; each stream adds the
value times a gate that measures how well the stream matches its key. The model runs this on the
full hc streams just before an Engram layer's first mHC site.

The rules follow DeepSeek-V4.1's inference/engram.py (token map, multipliers, hash) and
inference/model.py (Engram: gather, wkv, gate):
- a class id is the order in which its key first appears over ascending token ids;
- n-gram slot s (the token s positions back) is weighted by an odd multiplier per layer and slot;
  the hash of the n-gram of the s + 1 newest tokens is the XOR of the first s + 1 weighted classes;
- a slot before the sequence start, and every farther one, holds the pad token's class;
- the gate: sigmoid of the signed square root of the RMS-normalised dot product of stream and key,
  weighted by q_weight * k_weight, in fp32, with one rounding of the result to the streams' dtype.

Two imports beyond torch, because the reference's values come from them: numpy, whose default
generator (PCG64) draws the hash multipliers (only numpy reproduces its stream), and `tokenizers`,
whose normaliser chain (Unicode tables included) decides which tokens share a class.

The tables (hundreds of millions of rows) stay as the checkpoint stores them, in host memory
(model/weights.py): a step gathers its rows there, dequantizes only those rows and moves them to
the streams' device.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from .. import formats, v41
from ..config import ModelConfig
from ..config_fields import ConfigError

MULTIPLIER_SEED = 10007  # layer id times this seeds the layer's multiplier generator
GATE_FLOOR = 1e-6  # |dot| is raised to at least this before its square root
SPACE_SENTINEL = "\ue000"  # a private-use character that stands in for a lone space through Strip
BEFORE_START = -1  # an n-gram slot before the sequence start


# --- the token map ------------------------------------------------------------------------------
def compressed_token_map(config: ModelConfig, tokenizer_path=None) -> torch.Tensor:
    """Each token id's class, LongTensor [vocab_size].

    With a `tokenizer.json`: the official classes (see `_token_key`), numbered in order of first
    appearance over ascending ids; their count must be engram_compressed_vocab_size. Ids past the
    tokenizer's vocabulary (the model's vocab_size may be larger) have no text, so the reference
    never hashes them, but a sampler can still emit one: each gets a class of its own after the
    tokenizer's, so that none merges with a text token. Such a class is >= the compressed vocab,
    so its products with the multipliers may exceed int64 and wrap; its rows stay in range.

    Without a tokenizer (random-weight presets, synthetic checkpoints: there is no text to
    normalise) a stand-in: id % engram_compressed_vocab_size, which uses exactly that many classes
    when vocab_size >= it.
    """
    if tokenizer_path is None:
        return torch.arange(config.vocab_size) % config.engram_compressed_vocab_size
    from tokenizers import Tokenizer

    tokenizer, normaliser = Tokenizer.from_file(str(tokenizer_path)), _normaliser()
    keys: dict[str, int] = {}
    classes = [keys.setdefault(_token_key(tokenizer, normaliser, token), len(keys))
               for token in range(tokenizer.get_vocab_size(with_added_tokens=True))]
    if len(keys) != config.engram_compressed_vocab_size:
        raise ConfigError(
            f"{tokenizer_path}: its {len(classes)} tokens normalise to {len(keys)} classes, but "
            f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size}: the Engram token "
            "map must have exactly that many (is this the checkpoint's own tokenizer?)")
    untokenized = range(len(keys), len(keys) + config.vocab_size - len(classes))
    return torch.tensor((classes + list(untokenized))[:config.vocab_size])


def _normaliser():
    """The reference's normalisation of a token's text: compatibility forms, accents and case
    dropped, whitespace runs made one space, outer whitespace stripped, except that a token that
    is only whitespace keeps one space (the sentinel hides it from Strip)."""
    from tokenizers import Regex, normalizers as n

    return n.Sequence([n.NFKC(), n.NFD(), n.StripAccents(), n.Lowercase(),
                       n.Replace(Regex("[ \t\r\n]+"), " "), n.Replace(Regex("^ $"), SPACE_SENTINEL),
                       n.Strip(), n.Replace(SPACE_SENTINEL, " ")])


def _token_key(tokenizer, normaliser, token: int) -> str:
    """What decides a token's class: its decoded text (specials included) normalised. A token that
    decodes to U+FFFD (part of a multi-byte character) keys by its vocab string, which tells the
    parts apart; one whose normalised text is empty (e.g. a lone combining accent) by its text."""
    text = tokenizer.decode([token], skip_special_tokens=False)
    if "\ufffd" in text:
        return tokenizer.id_to_token(token)
    return normaliser.normalize_str(text) or text


def ngram_ids(token_map: torch.Tensor, current: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """The classes of each row's n-gram slots, [N, max_ngram_size]: `current` [N] raw token ids and
    `history` [N, max_ngram_size - 1], whose column s - 1 holds the raw id s positions back or -1
    before the sequence start; -1 is kept."""
    raw = torch.cat([current.unsqueeze(1), history], dim=1)
    classes = token_map.to(raw.device)[raw.clamp(min=0)]
    return torch.where(raw < 0, BEFORE_START, classes)


# --- the hash -----------------------------------------------------------------------------------
def hash_multipliers(config: ModelConfig) -> torch.Tensor:
    """Each Engram layer's odd multiplier per n-gram slot, LongTensor [layers, max_ngram_size]."""
    return torch.tensor(_multipliers(tuple(config.engram_layer_ids), config.engram_max_ngram_size,
                                     config.engram_compressed_vocab_size))


@functools.lru_cache(maxsize=16)
def _multipliers(layer_ids: tuple[int, ...], slots: int, classes: int) -> tuple[tuple[int, ...], ...]:
    # The bound keeps class * multiplier below 2**63 for every class < `classes`: the int64 products
    # never wrap (DeepSeek-V4.1's inference/engram.py, compute_hash_multipliers).
    bound = max(1, (2**63 - 1) // classes // 2)
    draws = [np.random.default_rng(MULTIPLIER_SEED * layer).integers(0, bound, size=slots, dtype=np.int64)
             for layer in layer_ids]
    return tuple(tuple(2 * int(v) + 1 for v in row) for row in draws)


def hash_buckets(config: ModelConfig, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram layer `slot`'s (index in engram_layer_ids) bucket count per hash column (a prime)
    and where the column's bucket range starts in the layer's table, LongTensors [columns]."""
    primes = torch.tensor(v41.engram_primes(len(config.engram_layer_ids), config.engram_max_ngram_size,
                                            config.engram_n_heads, config.engram_vocab_size)[slot])
    return primes, primes.cumsum(0) - primes


def hash_rows(config: ModelConfig, slot: int, ngrams: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The table rows, int64 [N, columns], of `ngrams` [N, max_ngram_size] (classes, column s the
    token s positions back, -1 before the sequence start) in Engram layer `slot`; `pad_id` is the
    pad token's class. Column (n - 2) * heads + head is head `head` of the n-gram of n tokens."""
    primes, offsets = hash_buckets(config, slot)
    return _hashed(ngrams, hash_multipliers(config)[slot], primes, offsets, config.engram_n_heads, pad_id)


def _hashed(ngrams: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
            heads: int, pad_id: int) -> torch.Tensor:
    """`hash_rows` with the layer's constants given (on the n-grams' device)."""
    device = ngrams.device
    multipliers, primes, offsets = (t.to(device) for t in (multipliers, primes, offsets))
    # Sticky: once a slot lies before the start, it and every farther slot hold the pad's class.
    blocked = (ngrams < 0).cumsum(dim=1) > 0
    values = torch.where(blocked, pad_id, ngrams.long())
    rolling = torch.zeros_like(values[:, 0])
    columns = []
    for s in range(values.shape[1]):
        rolling = rolling ^ (values[:, s] * multipliers[s])
        if s:  # rolling now hashes the n-gram of the s + 1 newest tokens; its heads differ by bucket range
            order = slice((s - 1) * heads, s * heads)
            columns.append(rolling.unsqueeze(1) % primes[order] + offsets[order])
    return torch.cat(columns, dim=1)


# --- the layer ----------------------------------------------------------------------------------
class Engram:
    """One Engram layer (`layer` in engram_layer_ids), weights under `prefix` (`layers.{i}.engram.`).
    The table is `weights[prefix + "embed"]` as read_weights keeps it: (FP8 codes, UE8M0 scales)
    or (plain tensor,), in host memory; wkv, q_weight and k_weight are dense, on the device."""

    def __init__(self, config: ModelConfig, weights: dict, prefix: str, layer: int, token_map: torch.Tensor):
        self.c, self.slot = config, config.engram_layer_ids.index(layer)
        self.table = weights[f"{prefix}embed"]
        self.wkv = weights[f"{prefix}wkv"]
        # The gate reads only the product of the two weights, formed in fp32 as the reference does.
        self.gate_weight = weights[f"{prefix}q_weight"].float() * weights[f"{prefix}k_weight"].float()
        self.pad_id = int(token_map[config.engram_pad_token_id])
        # the hash's constants, made once on the device rather than every step
        device = self.wkv.device
        self.multipliers = hash_multipliers(config)[self.slot].to(device)
        self.primes, self.offsets = (t.to(device) for t in hash_buckets(config, self.slot))

    def __call__(self, streams: torch.Tensor, ngrams: torch.Tensor) -> torch.Tensor:
        """streams [N, hc, d] and their rows' `ngrams` [N, max_ngram_size] (see `hash_rows`) ->
        the streams with the gated value added, in the streams' dtype."""
        rows = _hashed(ngrams, self.multipliers, self.primes, self.offsets, self.c.engram_n_heads, self.pad_id)
        keys, value = self.project(self.gather(rows).to(self.wkv.device))
        return gated_update(streams, keys, value, self.gate_weight, self.c.rms_norm_eps)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The table rows `rows` [N, columns] side by side, [N, columns * width] in the compute
        dtype, on the table's device: column c's values at c * width .. (c + 1) * width - 1."""
        index = rows.flatten().to(self.table[0].device)
        dtype = self.wkv.dtype
        if len(self.table) == 2:
            codes, scale = self.table
            picked = formats.dequantize_fp8_block(codes[index], scale[index], (1, v41.ENGRAM_SCALE_GROUP), dtype)
        else:
            picked = self.table[0][index].to(dtype)
        return picked.view(rows.shape[0], rows.shape[1] * picked.shape[1])  # explicit: a step may have no rows

    def project(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features [N, columns * width] -> (keys [N, hc, d], value [N, d]), fp32 from the compute
        dtype: wkv's output chunks are stream 0's key, ..., stream hc - 1's key, then the value."""
        hc, d = self.c.hc_mult, self.c.hidden_size
        kv = F.linear(features, self.wkv).float()
        return kv[:, :hc * d].view(-1, hc, d), kv[:, hc * d:]


def gated_update(streams: torch.Tensor, keys: torch.Tensor, value: torch.Tensor, gate_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """streams [N, hc, d] + gate [N, hc] * value [N, d] per stream, rounded once to the streams'
    dtype. The gate, in fp32: dot = sum(stream * gate_weight * key) / (rms(stream) rms(key) sqrt(d))
    with rms(x) = sqrt(mean(x^2) + eps), gate = sigmoid(sign(dot) sqrt(max(|dot|, GATE_FLOOR))); the
    sign is copysign's, as in the reference (a dot of -0.0 counts negative)."""
    h = streams.float()
    scale = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(keys.square().mean(-1) + eps)
    dot = (h * gate_weight * keys).sum(-1) * scale * h.shape[-1] ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=GATE_FLOOR).sqrt(), dot))
    return (h + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(streams.dtype)
