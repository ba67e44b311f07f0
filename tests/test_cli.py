import json
import socket
import subprocess
import sys

import pytest
import torch

import monodecode.model
from monodecode import __version__
from monodecode.checkpoint import Checkpoint
from monodecode.cli import main
from monodecode.config import preset

BLOCK_SPEC = '{"method": "dspark", "num_speculative_tokens": 5, "rejection_sample_method": "%s"}'


def test_inspect_v4_flash_reports_the_layer_byte_counts(capsys):
    assert main(["inspect", "v4-flash"]) == 0
    out = capsys.readouterr().out
    assert "  window    2  0, 1\n" in out
    assert "  csa      21  2-42 step 2\n" in out
    assert "  hca      20  3-41 step 2\n" in out
    # dense bytes per layer kind (hash layers read tid2eid rows instead of the 1 KiB bias) and
    # six 12.75 MiB experts
    assert "window (hash-routed)    131.03 MiB   76.50 MiB  207.53 MiB" in out
    assert "hca                     139.28 MiB   76.50 MiB  215.78 MiB" in out
    assert "csa                     159.55 MiB   76.50 MiB  236.05 MiB" in out
    assert "whole target model" in out and "10.45 GiB" in out


def test_inspect_rows_scale_the_experts(capsys):
    assert main(["inspect", "v4-flash", "--rows", "48"]) == 0
    out = capsys.readouterr().out
    # 48 rows x top-6 = 288 picks, capped at the 256 experts: 256 x 12.75 MiB
    assert "hca                     139.28 MiB    3.19 GiB" in out


def test_make_checkpoint_then_inspect(tmp_path, capsys):
    out_dir = tmp_path / "tiny3"
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(out_dir), "--layers", "3",
                 "--seed", "5"]) == 0
    assert "wrote" in capsys.readouterr().out
    ckpt = Checkpoint(out_dir)
    assert ckpt.config.num_hidden_layers == 3
    assert json.loads((out_dir / "config.json").read_text())["compress_ratios"] == [0, 4, 16]
    assert main(["inspect", str(out_dir)]) == 0
    assert "all tensors checked" in capsys.readouterr().out


def test_errors_exit_2_with_a_message(tmp_path, capsys):
    assert main(["inspect", "no-such-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["inspect", str(tmp_path / "x")]) == 2
    assert "model_type 'llama' is not supported" in capsys.readouterr().err


def test_console_script_entry_point():
    result = subprocess.run([sys.executable, "-m", "monodecode.cli", "inspect", "tiny"],
                            capture_output=True, text=True, check=True)
    assert "preset tiny" in result.stdout


def test_generate_default_model_says_it_is_noise(capsys):
    assert main(["generate", "--max-tokens", "5"]) == 0
    assert "output is noise" in capsys.readouterr().err


def test_generate_takes_text_as_serve_does(capsys):
    """The default model has no tokenizer.json; like serve, generate takes and returns text
    through the byte-level fallback (byte b is id b + 3): the same as the prompt's ids."""
    assert main(["generate", "--prompt", "Hi", "--max-tokens", "6"]) == 0
    text = capsys.readouterr().out
    assert main(["generate", "--prompt-ids", ",".join(str(b + 3) for b in b"Hi"), "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out == text


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
def test_generate_at_tensor_parallel_size_2_gives_the_one_process_tokens(capsys, speculate):
    """`--tensor-parallel-size 2`: this process and a second over gloo, the same tokens, sampled
    (seeded) and, with the DSpark draft, the same acceptance."""
    args = ["generate", "--prompt-ids", "5,6,7", "--max-tokens", "12", "--temperature", "0.8", "--seed", "3"]
    if speculate:
        args += ["--speculative-config", '{"method": "dspark", "num_speculative_tokens": 5}']
    assert main(args) == 0
    one = capsys.readouterr()
    assert main(args + ["--tensor-parallel-size", "2"]) == 0
    two = capsys.readouterr()
    assert two.out == one.out
    assert not speculate or two.err.splitlines()[-1] == one.err.splitlines()[-1]  # the acceptance line


def test_tensor_parallel_sizes_the_model_cannot_take_are_refused_before_loading(capsys):
    assert main(["generate", "--tensor-parallel-size", "4"]) == 2  # the tiny preset has 2 o groups
    assert "tensor parallel size 4 must divide the o_groups 2" in capsys.readouterr().err
    assert main(["serve", "--tensor-parallel-size", "0"]) == 2
    assert "is not a positive number of ranks" in capsys.readouterr().err


def test_generate_refuses_text_for_a_vocabulary_too_small_for_bytes(tmp_path, capsys):
    config = preset("tiny", vocab_size=200, dspark_noise_token_id=199)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hello"]) == 2
    assert "its 200 ids are too few for the byte-level fallback: pass --prompt-ids" in capsys.readouterr().err


def test_generate_with_a_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    out_dir = tmp_path / "tok"
    main(["make-checkpoint", "--preset", "tiny", "--out", str(out_dir), "--layers", "2"])
    vocab = {f"w{i}": i for i in range(512)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    capsys.readouterr()
    assert main(["generate", "--model", str(out_dir), "--prompt", "w5 w17 w300",
                 "--max-tokens", "6"]) == 0
    captured = capsys.readouterr()
    words = captured.out.split()
    assert 1 <= len(words) <= 6 and all(w.startswith("w") for w in words)
    assert "noise" not in captured.err
    # the same prompt as ids gives the same continuation (decoded, since there is a tokenizer)
    assert main(["generate", "--model", str(out_dir), "--prompt-ids", "5,17,300", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out.split() == words


def test_generate_errors(capsys):
    assert main(["generate", "--prompt-ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["generate", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_version(capsys):
    assert main(["--version"]) == 0 and capsys.readouterr().out == f"monodecode {__version__}\n"


def test_help_shows_defaults_and_what_generate_runs_on(capsys):
    assert main(["--help"]) == 0
    assert "per-op path" not in capsys.readouterr().out  # generate runs decode steps on mono where it can
    assert main(["serve", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 127.0.0.1)", "(default: 8000)", "(default: 8)", "(default: 512)", "(default: cpu)",
                    "(default: float32)"):
        assert default in out
    assert main(["generate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 32)" in out and "(default: 0.0)" in out and "(default: 1.0)" in out


def refused_at_parse(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: monodecode")  # argparse's refusal, before anything runs
    return err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_flags_are_named_without_a_traceback(command, capsys):
    err = refused_at_parse([command, "--device", "tpu"], capsys)
    assert "argument --device: 'tpu' is not a device: use cpu, cuda or cuda:N" in err
    if not torch.cuda.is_available():
        err = refused_at_parse([command, "--device", "cuda"], capsys)
        assert "argument --device: 'cuda': this torch" in err and "sees no CUDA GPU" in err
    err = refused_at_parse([command, "--speculative-config", '{"method": dspark}'], capsys)
    assert "argument --speculative-config: speculative config is not valid JSON" in err
    err = refused_at_parse([command, "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 5}'], capsys)
    assert "argument --speculative-config: speculative config: method must be 'dspark'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["bench", "layer", "--widths", "0,2"], "argument --widths: '0,2': widths must be comma-separated whole numbers from 1 to 48"),
    (["bench", "layer", "--widths", "1,x"], "argument --widths: '1,x': widths must be"),
    (["bench", "layer", "--context", "-5"], "argument --context: '-5' is not a positive whole number"),
    (["bench", "layer", "--preset", "tiny4"], "argument --preset: invalid choice: 'tiny4'"),
    (["bench", "decode", "--requests", "1,9"], "argument --requests: '1,9': request counts must be comma-separated "
                                               "whole numbers from 1 to 8"),
    (["bench", "decode", "--layers", "none"], "argument --layers: 'none' is not a positive whole number"),
])
def test_bench_flags_are_refused_before_anything_runs(argv, message, capsys):
    assert message in refused_at_parse(argv, capsys)


def test_bench_device_and_kinds_errors_are_named(capsys):
    if not torch.cuda.is_available():  # the default device, checked by the commands that use it
        for command in ("layer", "decode"):
            assert main(["bench", command, "--preset", "tiny"]) == 2
            err = capsys.readouterr().err
            assert "monodecode bench: error: --device 'cuda': this torch" in err and "Traceback" not in err
    assert main(["bench", "layer", "--preset", "tiny", "--device", "cpu", "--kinds", "window,MLA"]) == 2
    assert "monodecode bench: error: --kinds: unknown MLA (known: window, CSA, HCA)" in capsys.readouterr().err


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails a test that loads a model: the check under test must come first."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(monodecode.model.Model, "from_checkpoint", load)  # every load goes through it


def test_serve_checks_the_port_and_the_length_before_loading(no_model_load, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"--host 127.0.0.1 --port {port}: cannot listen there (Address already in use)" in capsys.readouterr().err
    assert main(["serve", "--max-model-len", "8192"]) == 2
    assert "max_model_len (--max-model-len) 8192 is beyond tiny's max_position_embeddings, 4096" in capsys.readouterr().err
    err = refused_at_parse(["serve", "--port", "70000"], capsys)
    assert "argument --port: '70000' is not a port number (0-65535)" in err


def test_greedy_verification_at_a_temperature_is_refused_before_loading(no_model_load, capsys):
    assert main(["generate", "--temperature", "0.7", "--speculative-config", BLOCK_SPEC % "greedy"]) == 2
    assert "temperature must be 0 with greedy speculative verification" in capsys.readouterr().err


def test_greedy_verification_refuses_sampling_in_the_api(capsys):
    """generate_speculative (SpeculativeDecoder.prefill) refuses the pair too, not only the CLI."""
    from monodecode.generate import generate_speculative
    from monodecode.spec.config import SpeculativeConfig

    model = monodecode.model.load_model("tiny")
    with pytest.raises(ValueError, match="temperature must be 0 with greedy"):
        generate_speculative(model, [5, 6], 4, SpeculativeConfig.from_json(BLOCK_SPEC % "greedy"), temperature=0.5)
