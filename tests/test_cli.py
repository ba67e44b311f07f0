import json
import subprocess
import sys

from monodecode.checkpoint import Checkpoint
from monodecode.cli import main


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
    captured = capsys.readouterr()
    assert "output is noise" in captured.err
    ids = [int(t) for t in captured.out.strip().split(",")]
    assert len(ids) == 5 and all(0 <= t < 512 for t in ids)


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
    assert main(["generate", "--prompt", "hello"]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
    assert main(["generate", "--prompt-ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["generate", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
