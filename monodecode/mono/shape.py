"""`LaunchShape`: how the persistent kernels are launched and tiled.

Results do not depend on it beyond fp32 summation order (tests check each shape they use against
the same reference). `k1_programs_per_sm` co-resident programs on every SM of `k1_warps` warps in
K1, `k2_programs_per_sm` of `k2_warps` in K2, `expert_programs_per_sm` of
`expert_warps` in K3 (the routed experts; and the expert stage alone), their registers capped so
that they fit (`expert_registers`);
dense GEMV tasks of a step of two rows or more of `block_n` outputs (0: 128 in programs of 8
warps, 64 in fewer) over `dense_chunk` elements of K (a longer K is split into slices summed in
order; 0: each GEMV's slices balance the programs, `gemv_tiles.balanced_split`) in K steps of
`block_k` (`gemv_tiles.kernel_blocks`; a one-row step's tiles follow
`gemv_tiles.single_row_blocks` instead), `dense_stages` K steps deep in Triton's software pipeline
(every width); expert tasks of `expert_block_n` outputs over K steps of `expert_block_k` (a
multiple of 128, the fragment order's column group; with 256, tasks of one or two rows take the
diagonal loop: experts.py); fold tasks of up to `fold_rows` rows, a settle task collapsing
its row in tiles of `settle_columns` columns (0: 512 a warp, the whole row at v4-flash sizes,
in registers; fewer: a second pass over the row, less code) (`hc.seam_blocks`); a compressed
layer's attend spreading each (row, head block)'s entries over `attend_splits` tasks (0: as many
as fill what the output parts leave of the programs, `attention.compressed_layout`; else that
many, a power of two: what the interpreter's one program needs to run the split tasks at all);
the attend spreading each pair's output chunks over `attend_parts` tasks (0: as many as fill the
programs, on a compressed layer half of them, `attention.output_parts`; else that many, a power
of two up to head_dim / 64, and no more than the chunks a head has); attend tasks of
`attend_heads` heads (16, 32 or 64) in chunks of `attend_chunk` channels (64 or 128; 0 for
either: 16 and 64, on a CSA layer chunks of 128 from 16 rows, on CSA and window layers 32 heads
once the pairs of 16 heads outnumber the programs, `attention.attend_tile`); a CSA layer's
top-k selection taking a row's scores in tasks of `select_block` entries in each of its stages (0:
256 below 32 rows of a step, 1024 from 32, `indexer.select_block`; else that many, a power of
two; `indexer.select_stage`).
The defaults are the fastest shapes measured (docs/notes/; on the H200; `attend_parts` at 1-6 and
48 rows on an H100, on the H200 at 16 rows only, a compressed layer's (splits, parts, split parts) at 1 and 6
rows on an H100 only; `select_block` at 16 K cached tokens on an H100 only; a CSA layer's attend tile at
16 and 48 rows, 512 and 16 K cached tokens, and a window layer's 32-head tasks at 48 rows and 512, on an
H100 only).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class LaunchShape:
    k1_programs_per_sm: int = 1
    k2_programs_per_sm: int = 1
    k1_warps: int = 8
    k2_warps: int = 8
    block_n: int = 0
    block_k: int = 128
    dense_chunk: int = 0
    dense_stages: int = 4
    expert_block_n: int = 128
    expert_block_k: int = 256
    expert_programs_per_sm: int = 2
    expert_warps: int = 8
    fold_rows: int = 16
    settle_columns: int = 0
    attend_splits: int = 0
    attend_parts: int = 0
    attend_heads: int = 0
    attend_chunk: int = 0
    select_block: int = 0

    def expert_registers(self) -> int:
        """Registers a thread of K3 may take so that `expert_programs_per_sm` programs of
        `expert_warps` warps fit a SM's 64 K (in the allocation's steps of 8, at most 255)."""
        return min(255, 65536 // (32 * self.expert_warps * self.expert_programs_per_sm) // 8 * 8)

    def spec(self) -> str:
        """The fields that differ from the defaults, as `parse` reads them ("default" if none)."""
        changed = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != f.default]
        return ",".join(changed) or "default"

    @classmethod
    def parse(cls, text: str) -> "LaunchShape":
        """`default`, or comma-separated field=value (whole numbers): "k2_warps=8,expert_block_n=128"."""
        if text.strip() == "default":
            return cls()
        names = [f.name for f in fields(cls)]
        values = {}
        for item in text.split(","):
            name, _, value = (part.strip() for part in item.partition("="))
            if name not in names or not value:
                raise ValueError(f"launch shape {text!r}: {item!r} is not field=value with a field of "
                                 f"{', '.join(names)}")
            if not value.isdigit():
                raise ValueError(f"launch shape {text!r}: {name} must be a whole number, got {value!r}")
            values[name] = int(value)
        return cls(**values)
