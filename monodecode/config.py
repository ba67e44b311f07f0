"""ModelConfig: the DeepSeek-V4 hyper-parameters, from a Hugging Face `config.json` or a preset.

Both spellings of `config.json` in the wild (the official one and transformers') are read:
config_json.py.

A layer's attention kind follows from its compression ratio: 0 is a sliding-window layer, 4 a CSA
layer (overlapping compressor and lightning indexer), any other ratio an HCA layer (one compressor
window per `ratio` tokens, all entries attended). `to_dict()` writes the official spelling.

DeepSeek-V4.1 (`model_type: deepseek_v41`, the multimodal config with the text model nested under
`text_config`, or `deepseek_v41_text`, the text config itself) is read as its text model only:
`ModelConfig.model_type` is then `deepseek_v41_text`, and the vision part (`vision_config`, image
tokens) is not supported. V4.1 compresses at ratios 2 and 1, and its compressed layers share work:
only the `kv_source_layer_ids` compute compressed KV and only the `index_source_layer_ids` run an
indexer; every other compressed layer reads the latest source at or below it (`kv_source_of`,
`index_source_of`). All its compressed layers are sparse (indexed), so their kind is "csa".
`v41.py` holds the V4.1-only rules (the source maps, the Engram table sizes, the checks).

Every field is checked for its type (an integer is not `true` or `4.5`, a number is not a
string) before it is used, and every error names the field, the expected value and, when the
config comes from a file, the file.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import v41
from .config_fields import ConfigError, as_json, check_fields, is_int

POSITIVE = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
    "o_groups", "o_lora_rank", "sliding_window", "n_routed_experts", "num_experts_per_tok",
    "moe_intermediate_size", "hc_mult", "index_n_heads", "index_head_dim", "index_topk",
)  # fields that must be positive counts
SUPPORTED_MODEL_TYPES = ("deepseek_v4", v41.TEXT_MODEL_TYPE)  # what ModelConfig.model_type may be
READ_MODEL_TYPES = ("deepseek_v4", v41.MODEL_TYPE, v41.TEXT_MODEL_TYPE)  # what config.json may say
CSA_RATIO = 4
LAYER_TYPE_BY_KIND = {
    "window": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}
KIND_BY_LAYER_TYPE = {v: k for k, v in LAYER_TYPE_BY_KIND.items()}
DEFAULT_HCA_RATIO = 128


@dataclass(frozen=True)
class YarnScaling:
    DESCRIPTION: typing.ClassVar[str] = "a YaRN rope_scaling object"  # in type errors (config_fields)
    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per decoder layer: 0 window, 4 CSA, else HCA
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    num_hash_layers: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)
    max_position_embeddings: int = 1048576
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    num_key_value_heads: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    # Speculative draft. num_nextn_predict_layers counts the `mtp.{k}` stages in the checkpoint.
    num_nextn_predict_layers: int = 0
    dspark_block_size: int | None = None
    dspark_markov_rank: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] | None = None
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    # DeepSeek-V4.1 only (None on V4): cross-layer sharing, candidate filtering, Engram (v41.py).
    kv_source_layer_ids: tuple[int, ...] | None = None  # the compressed layers that compute compressed KV
    index_source_layer_ids: tuple[int, ...] | None = None  # the compressed layers that run an indexer
    candidate_source_layer_id: int | None = None  # publishes candidate blocks for the indexers above it
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None  # positions a candidate block
    engram_layer_ids: tuple[int, ...] | None = None
    engram_num_embeddings: tuple[int, ...] | None = None  # table rows, one entry per Engram layer
    engram_max_ngram_size: int | None = None  # n-grams of 2..this many tokens are hashed
    engram_vocab_size: int | None = None  # each hash head's bucket count is the next unused prime above it
    engram_n_heads: int | None = None  # hash heads per n-gram order
    engram_head_dim: int | None = None  # width of one table row
    engram_pad_token_id: int | None = None  # stands in for tokens before the sequence start
    engram_compressed_vocab_size: int | None = None  # classes of the token map (tokens that normalise alike)
    quantization_config: dict[str, Any] | None = None
    model_type: str = "deepseek_v4"

    def __post_init__(self) -> None:
        _validate(self)

    def __getattr__(self, name: str):
        # Only reached for names that are not fields: say why the vision part's are absent.
        if name in v41.VISION_ONLY_FIELDS:
            raise v41.VisionNotSupported(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # --- derived ---------------------------------------------------------------------------
    @property
    def is_v41(self) -> bool:
        return self.model_type == v41.TEXT_MODEL_TYPE

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        if self.is_v41:  # every compressed V4.1 layer is sparse: an indexer picks its entries
            return tuple("window" if r == 0 else "csa" for r in self.compress_ratios)
        return tuple(layer_kind(r) for r in self.compress_ratios)

    def kv_source_of(self, layer: int) -> int | None:
        """The layer whose compressor computes the compressed KV `layer` attends (None: a window
        layer). On V4 every compressed layer is its own source."""
        if self.compress_ratios[layer] == 0:
            return None
        return v41.latest_at_or_below(self.kv_source_layer_ids, layer) if self.is_v41 else layer

    def index_source_of(self, layer: int) -> int | None:
        """The layer whose indexer picks `layer`'s compressed entries (None: none are picked, a
        window or V4 HCA layer). On V4 every CSA layer is its own source."""
        if self.compress_ratios[layer] == 0:
            return None
        if self.is_v41:
            return v41.latest_at_or_below(self.index_source_layer_ids, layer)
        return layer if self.compress_ratios[layer] == CSA_RATIO else None

    def uses_candidates(self, layer: int) -> bool:
        """Whether `layer`'s own indexer scores only inside the candidate blocks the candidate
        layer published (the index sources above it; V4.1 only)."""
        c = self.candidate_source_layer_id
        return c is not None and layer > c and layer in (self.index_source_layer_ids or ())

    def is_engram_layer(self, layer: int) -> bool:
        return layer in (self.engram_layer_ids or ())

    @property
    def delayed_hc_pre(self) -> bool:
        """V4.1's mHC collapses each sub-block's input with the previous sub-block's pre-mix."""
        return self.is_v41

    @property
    def q_head_norm(self) -> bool:
        """V4 RMS-normalises each query head after `wq_b`; V4.1 does not (its qr is normed before)."""
        return not self.is_v41

    @property
    def has_hc_head(self) -> bool:
        """V4 merges the final hc streams with a learned hc_head; V4.1 has none (it collapses
        with the last FFN pre-mix)."""
        return not self.is_v41

    @property
    def markov_tensor_names(self) -> tuple[str, str]:
        """The DSpark Markov head's two tables under `markov_head.` (V4.1 renamed V4's)."""
        return ("embed", "head") if self.is_v41 else ("markov_w1", "markov_w2")

    @property
    def dspark_captures_layer_input(self) -> bool:
        """DSpark reads the stream entering its target layers on V4.1, leaving them on V4."""
        return self.is_v41

    @property
    def engram_hash_columns(self) -> int:
        """Table rows an Engram layer gathers a token: (n-gram orders) x (heads an order)."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads if self.engram_layer_ids else 0

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def has_dspark(self) -> bool:
        return self.num_nextn_predict_layers > 0 and self.dspark_block_size is not None

    @property
    def draft_n_routed_experts(self) -> int:
        return self.dspark_n_routed_experts or self.n_routed_experts

    @property
    def draft_num_experts_per_tok(self) -> int:
        return self.dspark_num_experts_per_tok or self.num_experts_per_tok

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The (rows, cols) of one FP8 scale block, or None for an unquantized checkpoint."""
        q = self.quantization_config
        if not q:
            return None
        return tuple(q.get("weight_block_size", (128, 128)))

    @property
    def experts_fp4(self) -> bool:
        q = self.quantization_config or {}
        return q.get("expert_dtype") == "fp4"

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """The fields of a `config.json` object, in either spelling (config_json.py)."""
        from .config_json import parse  # it builds on this module's names

        return cls(**parse(raw))

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """The config.json of a checkpoint directory (or that file); errors name the file."""
        path = Path(path)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise ConfigError(f"no config.json at {config_file}")
        try:
            raw = json.loads(config_file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{config_file} is not UTF-8 text: {e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{config_file} is not valid JSON: {e}") from None
        except OSError as e:
            raise ConfigError(f"{config_file} cannot be read: {e.strerror}") from None
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{config_file}: {e}") from None

    def replace(self, **overrides: Any) -> "ModelConfig":
        return with_overrides(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """The official `config.json` spelling (also read by transformers)."""
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["rope_scaling"] = (
            {"type": "yarn", **dataclasses.asdict(self.rope_scaling)} if self.rope_scaling else None
        )
        for name, value in d.items():
            if isinstance(value, tuple):  # the per-layer id lists, as JSON lists
                d[name] = list(value)
        d["architectures"] = [v41.TEXT_ARCHITECTURE if self.is_v41 else "DeepseekV4ForCausalLM"]
        return {k: v for k, v in d.items() if v is not None}


def layer_kind(ratio: int) -> str:
    if ratio == 0:
        return "window"
    return "csa" if ratio == CSA_RATIO else "hca"


def with_overrides(config: ModelConfig, **overrides: Any) -> ModelConfig:
    """A copy with fields replaced. Changing the layer count trims or extends the per-layer
    lists (extending repeats the CSA/HCA alternation) and moves DSpark target layers that fall
    past the end onto the last layers, so `preset("v4-flash", num_hidden_layers=2)` just works."""
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ConfigError(f"unknown config field(s) {sorted(unknown)}")
    n = overrides.get("num_hidden_layers", config.num_hidden_layers)
    if config.is_v41 and is_int(n) and n != config.num_hidden_layers:
        overrides = {**v41.resized(config, n), **overrides}
    if n != config.num_hidden_layers and "compress_ratios" not in overrides:
        ratios = list(config.compress_ratios[:n])
        hca = next((r for r in config.compress_ratios if r not in (0, CSA_RATIO)), DEFAULT_HCA_RATIO)
        while len(ratios) < n:
            ratios.append(CSA_RATIO if len(ratios) % 2 == 0 else hca)
        overrides["compress_ratios"] = tuple(ratios)
    if "num_hash_layers" not in overrides:
        overrides["num_hash_layers"] = min(config.num_hash_layers, n)
    targets = overrides.get("dspark_target_layer_ids", config.dspark_target_layer_ids)
    if targets is not None and any(t >= n for t in targets):
        overrides["dspark_target_layer_ids"] = tuple(
            max(n - len(targets) + i, 0) for i in range(len(targets))
        )
    return dataclasses.replace(config, **overrides)


# --- validation -------------------------------------------------------------------------------
def _validate(c: ModelConfig) -> None:
    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    check_fields(ModelConfig, {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}, POSITIVE)
    check(c.model_type != v41.MODEL_TYPE,
          f"model_type {v41.MODEL_TYPE!r} is the multimodal wrapper; a ModelConfig describes its text "
          f"model: use {v41.TEXT_MODEL_TYPE!r}")
    check(c.model_type in SUPPORTED_MODEL_TYPES, f"model_type {c.model_type!r} is not supported")
    for name in ("rms_norm_eps", "hc_eps"):
        check(getattr(c, name) > 0, f"{name} must be positive, got {as_json(getattr(c, name))}")
    for name in ("bos_token_id", "eos_token_id"):
        token = getattr(c, name)
        check(token is None or 0 <= token < c.vocab_size,
              f"{name} must be a token id in [0, vocab_size = {c.vocab_size}), got {token}")
    check(c.scoring_func == "sqrtsoftplus",
          f"scoring_func {c.scoring_func!r} is not supported (DeepSeek-V4 uses 'sqrtsoftplus')")
    check(c.num_key_value_heads == 1,
          f"num_key_value_heads must be 1 (V4 shares one K=V head), got {c.num_key_value_heads}")
    check(len(c.compress_ratios) == c.num_hidden_layers,
          f"compress_ratios has {len(c.compress_ratios)} entries, num_hidden_layers is {c.num_hidden_layers}")
    for i, r in enumerate(c.compress_ratios):
        check(isinstance(r, int) and r >= 0, f"compress_ratios[{i}] must be >= 0, got {r!r}")
    if c.is_v41:
        v41.validate(c)
    else:
        v41.check_absent(c)
    check(0 < c.qk_rope_head_dim < c.head_dim and c.qk_rope_head_dim % 2 == 0,
          f"qk_rope_head_dim must be even and inside head_dim={c.head_dim}, got {c.qk_rope_head_dim}")
    check(c.num_attention_heads % c.o_groups == 0,
          f"num_attention_heads={c.num_attention_heads} is not divisible by o_groups={c.o_groups}")
    check(c.num_experts_per_tok <= c.n_routed_experts,
          f"num_experts_per_tok={c.num_experts_per_tok} exceeds n_routed_experts={c.n_routed_experts}")
    check(c.n_shared_experts in (0, 1), f"n_shared_experts must be 0 or 1, got {c.n_shared_experts}")
    check(0 <= c.num_hash_layers <= c.num_hidden_layers,
          f"num_hash_layers={c.num_hash_layers} is outside 0..{c.num_hidden_layers}")
    if c.dspark_target_layer_ids is not None:
        for t in c.dspark_target_layer_ids:
            check(0 <= t < c.num_hidden_layers,
                  f"dspark_target_layer_ids contains {t}, outside 0..{c.num_hidden_layers - 1}")
    if c.dspark_noise_token_id is not None:
        check(0 <= c.dspark_noise_token_id < c.vocab_size,
              f"dspark_noise_token_id={c.dspark_noise_token_id} is outside the vocabulary")
    if c.quantization_config is not None:
        q = c.quantization_config
        check(q.get("quant_method", "fp8") == "fp8",
              f"quantization_config.quant_method {q.get('quant_method')!r} is not supported (fp8)")
        check(q.get("fmt", "e4m3") == "e4m3",
              f"quantization_config.fmt {q.get('fmt')!r} is not supported (e4m3: the weights are "
              "read as float8_e4m3fn)")
        check(q.get("scale_fmt", "ue8m0") == "ue8m0",
              f"quantization_config.scale_fmt {q.get('scale_fmt')!r} is not supported (ue8m0)")
        check(q.get("expert_dtype", "fp4") in ("fp4", "fp8"),
              f"quantization_config.expert_dtype {q.get('expert_dtype')!r} is not supported")
        block = q.get("weight_block_size", [128, 128])
        check(isinstance(block, (list, tuple)) and len(block) == 2 and all(is_int(b) and b > 0 for b in block),
              f"quantization_config.weight_block_size must be two positive integers, got {as_json(block)}")


# The presets and `load_config` (presets.py) build ModelConfigs, so they import this module; they
# are re-exported here, where callers look for a config.
from .presets import PRESETS, load_config, preset  # noqa: E402, F401
