"""DeepSeek-V4.1's config rules: reading its config.json, its cross-layer source maps, its Engram
table sizes, and the checks that make a V4.1 ModelConfig consistent (config.py calls them).

What V4.1 changes against V4, as far as the config says:
- compression at ratio 2 (layers after the window layers) and ratio 1 (the later layers); only the
  `kv_source_layer_ids` compute compressed KV (each other compressed layer reads the latest source
  at or below it), only the `index_source_layer_ids` run an indexer (likewise shared);
- a two-level indexer: the candidate layer publishes `candidate_topk_blocks` blocks of
  `candidate_block_size` positions, and the indexers above it score only inside them;
- Engram on `engram_layer_ids`: n-gram hashes into a table per layer, gated into the hc streams;
- no hash-routed layers, rms_norm_eps 1e-20, FP8 with 32 x 32 scale blocks, no hc_head, the mHC
  pre-mix delayed by one sub-block, and a DSpark draft that reads the input of its target layers.
Only the text model is described; the vision tower and image inputs are not supported.
"""

from __future__ import annotations

import functools
from typing import Any

from .config_fields import ConfigError, as_json, get_field

MODEL_TYPE = "deepseek_v41"  # the multimodal config; its text model sits under text_config
TEXT_MODEL_TYPE = "deepseek_v41_text"  # the text model's own config (and ModelConfig.model_type)
TEXT_ARCHITECTURE = "DeepseekV41ForCausalLM"
RATIOS = (0, 1, 2)  # window, ratio-1 and ratio-2 compressed layers
ENGRAM_SCALE_GROUP = 32  # an Engram table row's FP8 values share one UE8M0 scale per 32
LIST_FIELDS = ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "engram_num_embeddings")
CANDIDATE_FIELDS = ("candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size")
ENGRAM_SCALARS = ("engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
                  "engram_pad_token_id", "engram_compressed_vocab_size")
SCALAR_FIELDS = CANDIDATE_FIELDS + ENGRAM_SCALARS
FIELDS = LIST_FIELDS + SCALAR_FIELDS  # V4.1 only: a deepseek_v4 config has none of them
# Fields of the multimodal config that only its vision part reads.
VISION_ONLY_FIELDS = ("vision_config", "image_token_id", "image_start_token_id", "image_end_token_id")


class NotBuilt(ConfigError):
    """Something built for DeepSeek-V4 only (the per-op layer benchmark) was given a DeepSeek-V4.1
    config; it would silently compute V4's semantics. (The mono kernels refuse V4.1 with their own
    reasons: mono/plan.py.)"""

    def __init__(self, what: str):
        super().__init__(f"DeepSeek-V4.1 ({TEXT_MODEL_TYPE}): {what} is not built yet. " + RUNS_ON)


RUNS_ON = ("V4.1 runs on the per-op path (`generate`, `serve`, the DSpark draft, tensor parallelism); the mono "
           "kernels and `bench layer` implement V4 only")


def refuse_to_run(config, what: str) -> None:
    """Raise NotBuilt if `config` is V4.1: `what` (e.g. "`bench layer`") cannot run it."""
    if config.is_v41:
        raise NotBuilt(what)


class VisionNotSupported(ConfigError, AttributeError):
    """A field only DeepSeek-V4.1's vision part needs was asked for (AttributeError too, so that
    `hasattr` and `getattr(config, name, default)` keep working)."""

    def __init__(self, name: str):
        super().__init__(
            f"{name} belongs to DeepSeek-V4.1's vision part, which monodecode does not support: it reads "
            "the text model only (text_config), and takes no image inputs"
        )


# --- reading config.json ------------------------------------------------------------------------
def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields of a V4.1 config.json: `text_config` of the multimodal config
    (with the wrapper's quantization_config when the text config has none), or a text config as
    is. The vision part (`vision_config`) is left out: only the text model is supported."""
    if raw.get("model_type") == TEXT_MODEL_TYPE:
        return raw
    text = raw.get("text_config")
    if text is None:
        raise ConfigError(f"model_type {MODEL_TYPE!r} nests its text model under text_config, which "
                          "config.json lacks")
    text = get_field(raw, "text_config", dict)
    inner_type = text.get("model_type", TEXT_MODEL_TYPE)
    if inner_type != TEXT_MODEL_TYPE:
        raise ConfigError(f"text_config.model_type must be {TEXT_MODEL_TYPE!r}, got {as_json(inner_type)}")
    out = {**text, "model_type": TEXT_MODEL_TYPE}
    for name in ("quantization_config", "expert_dtype"):  # may sit on the wrapper only
        if out.get(name) is None and raw.get(name) is not None:
            out[name] = raw[name]
    return out


# --- derived ------------------------------------------------------------------------------------
def latest_at_or_below(sources, layer: int) -> int | None:
    """The largest source id <= layer (sources ascending), or None."""
    below = [s for s in sources or () if s <= layer]
    return below[-1] if below else None


@functools.lru_cache(maxsize=64)
def engram_primes(n_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """Each Engram layer's bucket primes, order-major (n-gram order 2's heads, then order 3's, ...).
    Each (layer, n-gram order, head) owns a bucket range whose size is a prime: for every order the
    primes are taken upwards from above vocab_size - 1, skipping any prime an earlier (layer, order,
    head) took, so that all ranges differ (DeepSeek-V4.1's `inference/engram.py`, EngramLayout)."""
    taken: set[int] = set()
    layers = []
    for _ in range(n_layers):
        primes = []
        for _ in range(max_ngram_size - 1):
            candidate = vocab_size - 1
            for _ in range(n_heads):
                candidate += 1
                while candidate in taken or not _is_prime(candidate):
                    candidate += 1
                taken.add(candidate)
                primes.append(candidate)
        layers.append(tuple(primes))
    return tuple(layers)


def engram_table_rows(n_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> tuple[int, ...]:
    """The rows of each Engram layer's table: its bucket ranges back to back (engram_primes).
    (DeepSeek-V4.1-Flash: 384006168 and 384016682 rows.)"""
    return tuple(sum(p) for p in engram_primes(n_layers, max_ngram_size, n_heads, vocab_size))


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the first seven prime bases: exact for every n below 3.4e14."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17)
    if n in bases:
        return True
    if any(n % p == 0 for p in bases):
        return False
    odd, twos = n - 1, 0
    while odd % 2 == 0:
        odd, twos = odd // 2, twos + 1
    for a in bases:
        x = pow(a, odd, n)
        if x in (1, n - 1):
            continue
        for _ in range(twos - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def resized(config, n: int) -> dict[str, Any]:
    """The overrides that cut a V4.1 config to `n` layers, or extend it: cut, the per-layer id
    lists keep the ids below n (the Engram table sizes follow their layers); extended, the new
    layers repeat the last layer's ratio and read its sources."""
    ratios = tuple(config.compress_ratios[:n])
    ratios += ratios[-1:] * (n - len(ratios)) if ratios else ()
    out: dict[str, Any] = {"compress_ratios": ratios}
    for name in ("kv_source_layer_ids", "index_source_layer_ids"):
        out[name] = tuple(i for i in getattr(config, name) or () if i < n)
    if config.candidate_source_layer_id is not None and config.candidate_source_layer_id >= n:
        out.update(dict.fromkeys(CANDIDATE_FIELDS))
    if config.engram_layer_ids:
        kept = [k for k, i in enumerate(config.engram_layer_ids) if i < n]
        out["engram_layer_ids"] = tuple(config.engram_layer_ids[k] for k in kept)
        out["engram_num_embeddings"] = tuple(config.engram_num_embeddings[k] for k in kept)
        if not kept:
            out.update(dict.fromkeys(("engram_layer_ids", "engram_num_embeddings") + ENGRAM_SCALARS))
    return out


# --- checks -------------------------------------------------------------------------------------
def check_absent(c) -> None:
    """A deepseek_v4 config has none of V4.1's fields (the V4 model would silently ignore them)."""
    for name in FIELDS:
        if getattr(c, name) is not None:
            raise ConfigError(f"{name} is a DeepSeek-V4.1 field (model_type {TEXT_MODEL_TYPE}); a "
                              f"{c.model_type} config cannot have it")


def validate(c) -> None:
    """Every V4.1-specific rule; each error names the field and the offending value."""
    if c.num_hash_layers:
        raise ConfigError(f"num_hash_layers must be 0: DeepSeek-V4.1 has no hash-routed layers, "
                          f"got {c.num_hash_layers}")
    for i, r in enumerate(c.compress_ratios):
        if r not in RATIOS:
            raise ConfigError(f"compress_ratios[{i}] = {r}: DeepSeek-V4.1 layers have ratio 0 (window), 1 or 2")
    _check_sources(c, "kv_source_layer_ids")
    _check_sources(c, "index_source_layer_ids")
    _check_candidates(c)
    _check_engram(c)


def _check_sources(c, name: str) -> None:
    """`name` lists compressed layers, ascending; every compressed layer has one at or below it,
    of its own ratio (a layer reads the source's entries, one per `ratio` positions)."""
    sources = getattr(c, name)
    if sources is None:
        raise ConfigError(f"a {TEXT_MODEL_TYPE} config needs {name}")
    _check_ids(c, name, sources)
    for s in sources:
        if c.compress_ratios[s] == 0:
            raise ConfigError(f"{name} contains {s}, a window layer (compress_ratios[{s}] = 0)")
    for layer, ratio in enumerate(c.compress_ratios):
        if ratio == 0:
            continue
        source = latest_at_or_below(sources, layer)
        if source is None:
            raise ConfigError(f"layer {layer} is compressed but no {name} entry is at or below it")
        if c.compress_ratios[source] != ratio:
            raise ConfigError(f"layer {layer} (ratio {ratio}) would read layer {source} of {name}, whose "
                              f"ratio is {c.compress_ratios[source]}: a source serves layers of its own ratio")


def _check_ids(c, name: str, ids) -> None:
    for k, i in enumerate(ids):
        if not 0 <= i < c.num_hidden_layers:
            raise ConfigError(f"{name} contains {i}, outside 0..{c.num_hidden_layers - 1}")
        if k and i <= ids[k - 1]:
            raise ConfigError(f"{name} must be strictly ascending, got {list(ids)}")


def _check_candidates(c) -> None:
    given = [name for name in CANDIDATE_FIELDS if getattr(c, name) is not None]
    if not given:
        return
    if len(given) != len(CANDIDATE_FIELDS):
        missing = [name for name in CANDIDATE_FIELDS if name not in given]
        raise ConfigError(f"{', '.join(given)} given without {', '.join(missing)}: the candidate filter "
                          "needs all three")
    layer = c.candidate_source_layer_id
    if layer not in c.index_source_layer_ids:
        raise ConfigError(f"candidate_source_layer_id {layer} is not in index_source_layer_ids "
                          f"{list(c.index_source_layer_ids)}: candidates come from its indexer's scores")
    for name in ("candidate_topk_blocks", "candidate_block_size"):
        if getattr(c, name) <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {getattr(c, name)}")
    covered = c.candidate_topk_blocks * c.candidate_block_size
    if covered < c.index_topk:
        raise ConfigError(f"candidate_topk_blocks x candidate_block_size = {covered} positions, fewer than "
                          f"index_topk = {c.index_topk}: the indexers inside the candidates could not fill their top-k")


def _check_engram(c) -> None:
    layers = c.engram_layer_ids
    if not layers:
        stray = [name for name in ("engram_num_embeddings",) + ENGRAM_SCALARS if getattr(c, name) is not None]
        if stray:
            raise ConfigError(f"{stray[0]} is given but engram_layer_ids is empty")
        return
    _check_ids(c, "engram_layer_ids", layers)
    missing = [name for name in ("engram_num_embeddings",) + ENGRAM_SCALARS if getattr(c, name) is None]
    if missing:
        raise ConfigError(f"engram_layer_ids is given without {', '.join(missing)}")
    for name in ("engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size"):
        if getattr(c, name) <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {getattr(c, name)}")
    if c.engram_max_ngram_size < 2:
        raise ConfigError("engram_max_ngram_size must be >= 2 (n-grams of 2 and more tokens), "
                          f"got {c.engram_max_ngram_size}")
    if not 0 <= c.engram_pad_token_id < c.vocab_size:
        raise ConfigError(f"engram_pad_token_id must be a token id in [0, vocab_size = {c.vocab_size}), "
                          f"got {c.engram_pad_token_id}")
    if c.engram_compressed_vocab_size > c.vocab_size:
        raise ConfigError(f"engram_compressed_vocab_size {c.engram_compressed_vocab_size} exceeds vocab_size "
                          f"{c.vocab_size}: the token map merges tokens, it cannot add any")
    if c.quantization_config and c.engram_head_dim % ENGRAM_SCALE_GROUP:
        raise ConfigError(f"engram_head_dim {c.engram_head_dim} is not a multiple of {ENGRAM_SCALE_GROUP}, the "
                          "FP8 scale group of the Engram tables' rows")
    sizes = c.engram_num_embeddings
    if len(sizes) != len(layers):
        raise ConfigError(f"engram_num_embeddings has {len(sizes)} entries, engram_layer_ids {len(layers)}")
    expected = engram_table_rows(len(layers), c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size)
    if tuple(sizes) != expected:
        raise ConfigError(
            f"engram_num_embeddings = {list(sizes)}, but engram_max_ngram_size {c.engram_max_ngram_size}, "
            f"engram_n_heads {c.engram_n_heads} and engram_vocab_size {c.engram_vocab_size} make tables of "
            f"{list(expected)} rows (one prime-sized bucket range per layer, n-gram order and head)")

