"""tools/sharded_pytest.py: the GPU runs' parallel pytest (scripts/h200.sh tests-all)."""

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "sharded_pytest.py"


def _run(tmp_path, body: str, *args: str):
    (tmp_path / "test_some.py").write_text(body)
    return subprocess.run([sys.executable, str(TOOL), "--shards", "2", "--logs", str(tmp_path / "logs"), *args,
                           "--", "test_some.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_every_test_runs_once_over_the_shards_and_a_failure_fails_the_run(tmp_path):
    passing = "".join(f"def test_{i}():\n    assert True\n" for i in range(5))
    done = _run(tmp_path, passing)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 tests from 1 files in 2 shards" in done.stdout
    assert "3 passed" in done.stdout and "2 passed" in done.stdout
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["shard_0.txt", "shard_1.txt"]

    failing = _run(tmp_path, passing + "def test_broken():\n    assert False\n")
    assert failing.returncode == 1 and "1 failed" in failing.stdout


def test_a_list_of_ids_runs_just_those(tmp_path):
    (tmp_path / "ids.txt").write_text("test_some.py::test_1\ntest_some.py::test_3\n")
    done = _run(tmp_path, "".join(f"def test_{i}():\n    assert True\n" for i in range(5)), "--ids", "ids.txt")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 tests from the list ids.txt in 2 shards" in done.stdout
    assert done.stdout.count("1 passed") == 2
