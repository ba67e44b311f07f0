"""`monodecode ...`: the command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from . import __version__
from .checkpoint import Checkpoint, CheckpointError, write_synthetic_checkpoint
from .config import PRESETS, ConfigError, load_config
from .describe import GiB, describe_config, describe_layers, describe_step_bytes, describe_tensors
from .mono.plan import MAX_ROWS, MonoRefused
from .ranks import RankError
from .spec.config import SpeculativeConfig

DEFAULT_MODEL = "tiny"


MONO_HELP = ("decode steps of <= 48 rows on the mono kernels: auto (default) logs why they cannot run "
             "and runs per-op, on fails with the reasons, off never uses them")


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default, unless it has none or its help already says it."""

    def _get_help_string(self, action):
        help = action.help or ""
        if any(action.default is none for none in (None, False, argparse.SUPPRESS)) or "default" in help:  # `is`: 0 == False
            return help
        return f"{help} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows the defaults; its subcommands' parsers are Parsers too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=HelpFormatter, **kwargs)


def device_arg(text: str) -> str:
    """--device: a device this torch can run on, checked before any model loads."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: monodecode runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this torch ({torch.__version__}) sees no CUDA GPU (a CPU-only "
                                         "build, or no GPU visible); use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: there are {torch.cuda.device_count()} CUDA device(s)")
    return text


def port_arg(text: str) -> int:
    port = int(text) if text.isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)")
    return port


TP_HELP = ("ranks the model is split over, one process a device (rank r on cuda:r; on the CPU over gloo): "
           "attention heads, routed experts and the vocabulary divided (default: 1)")


def paths_arg(text: str) -> tuple[str, ...]:
    """`bench decode --paths`: names of `bench.decode.PATHS`, comma-separated, at least one."""
    from .bench.decode import PATHS

    paths = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise argparse.ArgumentTypeError(f"unknown path(s) {', '.join(unknown) or '(none given)'}: "
                                         f"choose from {', '.join(PATHS)}")
    return paths


def tensor_parallel_arg(text: str) -> int:
    size = int(text) if text.isdigit() else 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of ranks")
    return size


def counts_arg(low: int, high: int, what: str):
    """A type for comma-separated whole numbers in [low, high] (`what` names them in the error)."""
    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",")]
        if not all(t.isdigit() for t in items) or not all(low <= int(t) <= high for t in items):
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be comma-separated whole numbers "
                                             f"from {low} to {high}")
        return [int(t) for t in items]
    return parse


def positive_int_arg(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def layers_arg(text: str) -> str | int:
    return text if text == "fit" else positive_int_arg(text)


def speculative_config_arg(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="monodecode", description=__doc__)
    parser.add_argument("--version", action="version", version=f"monodecode {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser(
        "inspect", help="show a model's config, layer kinds, tensors and decode-step bytes"
    )
    inspect.add_argument("model", help=f"a checkpoint directory or a preset ({', '.join(PRESETS)})")
    inspect.add_argument("--rows", type=int, default=1, help="decode-step rows for the byte table")
    inspect.set_defaults(run=run_inspect)

    make = commands.add_parser(
        "make-checkpoint", help="write a synthetic checkpoint (official quantized format)"
    )
    make.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the model's sizes")
    make.add_argument("--out", required=True, type=Path, help="a new directory")
    make.add_argument("--layers", type=int, help="number of decoder layers (default: the preset's)")
    make.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    make.set_defaults(run=run_make_checkpoint)

    gen = commands.add_parser(
        "generate", help="continue a prompt (decode steps on the mono kernels where they can run, else per-op)")
    gen.add_argument("--model", default=DEFAULT_MODEL,
                     help=f"a checkpoint directory or a preset (default: {DEFAULT_MODEL}, random weights)")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text: through the checkpoint's tokenizer.json, or the byte-level "
                                         "fallback as for serve")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated (default: the BOS id)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (EOS stops sooner)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the probability mass kept")
    gen.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    gen.add_argument("--device", default="cpu", type=device_arg, help="cpu, cuda or cuda:N")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the compute dtype")
    gen.add_argument("--mono", default="auto", choices=["auto", "on", "off"], help=MONO_HELP)
    gen.add_argument("--tensor-parallel-size", type=tensor_parallel_arg, default=1, metavar="N", help=TP_HELP)
    gen.add_argument("--speculative-config", metavar="JSON", type=speculative_config_arg,
                     help='DSpark speculation, e.g. \'{"method": "dspark", "num_speculative_tokens": 5, '
                          '"rejection_sample_method": "block"}\'')
    gen.set_defaults(run=run_generate)

    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"a checkpoint directory or a preset (default: {DEFAULT_MODEL}, random weights)")
    serve.add_argument("--served-model-name", help="the name clients use (default: --model as given)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve.add_argument("--port", type=port_arg, default=8000, help="checked free before the model loads")
    serve.add_argument("--max-model-len", type=int, help="prompt + output tokens a request may have "
                                                         "(default: 4096, or less if the model is shorter)")
    serve.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded at once (cache slots)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=512, help="prompt tokens prefilled a step")
    serve.add_argument("--speculative-config", metavar="JSON", type=speculative_config_arg,
                       help="DSpark speculation, as for generate")
    serve.add_argument("--mono", default="auto", choices=["auto", "on", "off"], help=MONO_HELP)
    serve.add_argument("--tensor-parallel-size", type=tensor_parallel_arg, default=1, metavar="N", help=TP_HELP)
    serve.add_argument("--device", default="cpu", type=device_arg, help="cpu, cuda or cuda:N")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the compute dtype")
    serve.set_defaults(run=run_serve)

    add_bench_commands(commands)

    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a bad flag (2, its message printed), --help or --version (0)
        return e.code
    try:
        return args.run(args)
    except (ConfigError, CheckpointError, ValueError, MemoryError, MonoRefused, RankError) as e:
        print(f"monodecode {args.command}: error: {e}", file=sys.stderr)
        return 2


def run_make_checkpoint(args: argparse.Namespace) -> int:
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    config = load_config(args.preset, **overrides)
    out = write_synthetic_checkpoint(config, args.out, seed=args.seed)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({config.num_hidden_layers} layers, {size / GiB:.2f} GiB)")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from .decode import load
    from .engine.tokenizer import load_tokenizer
    from .generate import generate, generate_speculative

    spec = args.speculative_config
    if spec is not None:
        spec.check_temperature(args.temperature)  # before the model loads
    vocab_size = load_config(args.model).vocab_size
    tokenizer = load_tokenizer(args.model, vocab_size)  # as serve's: text in and out wherever there is one
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer.json, and its {vocab_size} ids are too few for the "
                             "byte-level fallback: pass --prompt-ids instead of --prompt")
        prompt_ids = tokenizer.encode(args.prompt)
    elif args.prompt_ids is not None:
        try:
            prompt_ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    else:
        prompt_ids = None
    if args.model == DEFAULT_MODEL:
        print(f"note: the default model is the '{DEFAULT_MODEL}' preset with seeded random weights; "
              "its output is noise. Pass --model DIR for a real checkpoint.", file=sys.stderr)
    model = load(args.model, device=args.device, dtype=getattr(torch, args.dtype), mono=args.mono,
                 tensor_parallel_size=args.tensor_parallel_size)
    config = model.config
    if prompt_ids is None:
        prompt_ids = [config.bos_token_id or 0]
    stop = (config.eos_token_id,) if config.eos_token_id is not None else ()
    sampling = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop_ids=stop)
    try:
        if spec is not None:
            out, stats = generate_speculative(model, prompt_ids, args.max_tokens, spec, **sampling)
        else:
            out, stats = generate(model, prompt_ids, args.max_tokens, **sampling), None
    finally:
        model.close()  # the other tensor-parallel ranks, if any
    print(tokenizer.decode(out) if tokenizer is not None else ",".join(map(str, out)))
    if stats is not None:
        print(describe_acceptance(stats, spec), file=sys.stderr)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from .serve import serve

    if args.model == DEFAULT_MODEL:
        print(f"note: the default model is the '{DEFAULT_MODEL}' preset with seeded random weights; "
              "its output is noise. Pass --model DIR for a real checkpoint.", file=sys.stderr)
    return serve(args)


def describe_acceptance(stats, spec) -> str:
    rates = " ".join(f"{r:.3f}" for r in stats.rates())
    line = (f"speculative ({spec.rejection_sample_method}): {stats.steps} verify steps, mean acceptance "
            f"length {stats.mean_acceptance_length:.3f}, per-position acceptance rates {rates}")
    if spec.rejection_sample_method == "synthetic":
        line += "\nsynthetic acceptance: for benchmarks only, the output tokens are not the model's"
    return line


def run_inspect(args: argparse.Namespace) -> int:
    if Path(args.model).is_dir():
        checkpoint = Checkpoint(args.model)
        checkpoint.validate()
        config, source = checkpoint.config, f"checkpoint {args.model} (all tensors checked)"
    else:
        config, source = load_config(args.model), f"preset {args.model}"
    print(f"{source}\n")
    print(describe_config(config))
    print(describe_layers(config))
    print(describe_tensors(config))
    print(describe_step_bytes(config, args.rows))
    return 0


def add_bench_commands(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks: a running server, one decoder layer")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_commands.add_parser(
        "serve", help="load an OpenAI-compatible completions server at fixed concurrency levels",
        description="Streams random prompts to /v1/completions, keeping each concurrency level's "
                    "requests in flight, and reports TTFT, TPOT, ITL, E2EL, throughput and "
                    "interactivity (metric definitions: monodecode/bench/serve.py).")
    serve.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", help="the model name to request (default: the first of /v1/models)")
    serve.add_argument("--concurrency", required=True, help="levels, comma-separated, e.g. 1,2,4,8")
    serve.add_argument("--num-prompts", type=int, required=True, help="requests at each level")
    serve.add_argument("--input-len", type=int, required=True, help="prompt tokens")
    serve.add_argument("--output-len", type=int, required=True, help="max_tokens of each request")
    serve.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos: true")
    serve.add_argument("--seed", type=int, default=0, help="seeds the random prompts")
    serve.add_argument("--prompt-format", choices=["token-ids", "text"], default="token-ids",
                       help="token ids (exact length), or random words for servers without token-id "
                            "prompts (about one token a word)")
    serve.add_argument("--token-id-range", default="1000:128000", metavar="LOW:HIGH",
                       help="prompt token ids are drawn from [LOW, HIGH) (default: ordinary "
                            "DeepSeek-V3/V4 tokens)")
    serve.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="a request not done by then fails (default: 600)")
    serve.add_argument("--out", type=Path, metavar="DIR",
                       help="where bench_serve.json and bench_serve.png go (default: bench-serve-DATE-TIME)")
    serve.set_defaults(run=run_bench_serve)
    layer = bench_commands.add_parser(
        "layer", help="one decoder layer of each kind, per-op and mono, against the bandwidth floor",
        description="Times a window, a CSA and an HCA layer at --preset sizes (synthetic weights, bf16) "
                    "at each width, per-op (eager) and mono, against the bytes the step must read over "
                    "the copy bandwidth measured in the same run (monodecode/bench/layer.py).")
    layer.add_argument("--preset", default="v4-flash", choices=sorted(PRESETS), help="model sizes")
    layer.add_argument("--widths", default="1,2,4,6,8,12,16,24,32,48", type=counts_arg(1, MAX_ROWS, "widths"),
                       help=f"rows a step, comma-separated (1 to {MAX_ROWS}: what the kernels take)")
    layer.add_argument("--context", type=positive_int_arg, default=512, help="tokens already cached a request")
    layer.add_argument("--reps", type=positive_int_arg, default=20, help="timed repetitions (the median is kept)")
    layer.add_argument("--device", default="cuda", help="cuda, or cpu to exercise the code under "
                                                        "Triton's interpreter (times meaningless)")
    layer.add_argument("--compile", metavar="MODE", help="also time the batched per-op layer under "
                                                         "torch.compile in this mode (e.g. max-autotune-no-cudagraphs)")
    layer.add_argument("--kinds", default="window,CSA,HCA", help="layer kinds to time, comma-separated")
    layer.add_argument("--shapes", default="default",
                       help="mono launch shapes to time, ';'-separated, each `default` or field=value,... of "
                            "monodecode.mono.shape.LaunchShape (e.g. 'default;k2_warps=8,expert_block_n=128')")
    layer.add_argument("--timeline", action="store_true",
                       help="also print and save the per-stage times of the mono kernels and the gaps between "
                            "their launches, as a CUDA graph replays them (GPU)")
    layer.add_argument("--tensor-parallel-size", type=tensor_parallel_arg, default=1, metavar="N",
                       help=TP_HELP + "; every rank times its part (mono, and the per-op layer eagerly), the floor "
                                      "is the bytes of the rank that reads the most")
    layer.add_argument("--out", default=".", help="where bench_layer.json (and bench_layer.png) go")
    layer.add_argument("--replot", metavar="JSON", help="measure nothing: print the table and write the PNG of a "
                                                        "saved bench_layer.json (e.g. one from a GPU host without "
                                                        "matplotlib)")
    layer.set_defaults(run=run_bench_layer)
    decode = bench_commands.add_parser(
        "decode", help="whole speculative decode steps of an N-layer model, per-op graph and mono",
        description="Times speculative decode steps (DSpark draft, synthetic acceptance) of the first N layers "
                    "of --preset at each request count, per-op (the verify step in a CUDA graph, the draft eager) "
                    "and on the mono kernels (the verify step and the draft's stages): step time split into draft, verify (head) and host work, tokens/s per "
                    "user (monodecode/bench/decode.py).")
    decode.add_argument("--preset", default="v4-flash", choices=sorted(PRESETS), help="model sizes")
    decode.add_argument("--layers", default="fit", type=layers_arg,
                        help="target layers: a number, or `fit` (as many as the GPU holds with the mono kernels' "
                             "copies; ~35 s a v4-flash layer to build)")
    decode.add_argument("--requests", default="1,2,4,8", type=counts_arg(1, MAX_ROWS // 6, "request counts"),
                        help=f"request counts, comma-separated (1 to {MAX_ROWS // 6}: the kernels take "
                             f"{MAX_ROWS} rows, 6 a request)")
    decode.add_argument("--acceptance", type=float, default=3.51,
                        help="synthetic acceptance: mean tokens committed a step (default 3.51)")
    decode.add_argument("--context", type=positive_int_arg, default=256, help="tokens prefilled a request")
    decode.add_argument("--temperature", type=float, default=0.0,
                        help="every request's temperature (default 0: greedy draft and appended tokens)")
    decode.add_argument("--top-p", type=float, default=1.0, help="every request's top-p (default 1: off)")
    decode.add_argument("--steps", type=positive_int_arg, default=20,
                        help="timed steps a request count (the median is kept)")
    decode.add_argument("--reps", type=positive_int_arg, default=20, help="timed repetitions of the head alone")
    decode.add_argument("--paths", default="per-op,stepwise,whole", type=paths_arg,
                        help="paths to time, comma-separated: per-op (the per-op graph), stepwise (mono stepwise), "
                             "whole (mono, the whole step)")
    decode.add_argument("--host-profile", action="store_true",
                        help="after each path's timed steps, as many more under torch.profiler: the host's "
                             "time a step by operation and, on a GPU, the device's by kernel (the top 12 of each; "
                             "in the report as host_profile)")
    decode.add_argument("--tensor-parallel-size", type=tensor_parallel_arg, default=1, metavar="N",
                        help=TP_HELP + "; over ranks only the mono stepwise path runs")
    decode.add_argument("--device", default="cuda", help="cuda, or cpu to exercise the code under Triton's "
                                                         "interpreter (times meaningless)")
    decode.add_argument("--out", default=".", help="where bench_decode.json goes")
    decode.set_defaults(run=run_bench_decode)


def run_bench_decode(args: argparse.Namespace) -> int:
    from .bench.decode import run

    check_device(args.device)
    return run(args)


def run_bench_layer(args: argparse.Namespace) -> int:
    from .bench.layer import run

    if not args.replot:  # replotting a saved run needs no device
        check_device(args.device)
    return run(args)


def check_device(text: str) -> None:
    """`device_arg`'s checks, for a --device whose default (cuda) only a command that uses it checks."""
    try:
        device_arg(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--device {e}") from None


def run_bench_serve(args: argparse.Namespace) -> int:
    from .bench.serve import run_bench_serve as run  # httpx and numpy only when benchmarking

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
