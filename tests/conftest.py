"""Test setup, in one place: the device and how Triton runs the kernels.

MONODECODE_TEST_DEVICE=cuda runs the tests on a GPU, the kernels compiled; the default is the CPU,
where the kernels run under Triton's interpreter (grid (1,)), which must be switched on before
any kernel module is imported, so here, before the tests are collected. Tests marked `gpu` need
a GPU and are skipped on the CPU; tests marked `cpu` run the kernels interpreted on the CPU
(a CPU model, gloo ranks) and are skipped in a GPU run, whose kernels are imported compiled.
Tests marked `slow` are the thorough versions of interpreter-heavy
tests (more steps, widths, layers) whose cheaper twins run by default; pyproject.toml deselects
them (`-m "not slow"`), `python -m pytest -m slow` runs them alone, `-m ""` runs everything.
"""

import os

import pytest

DEVICE = os.environ.get("MONODECODE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU (MONODECODE_TEST_DEVICE=cuda)")
    config.addinivalue_line("markers", "cpu: runs the kernels interpreted on the CPU (skipped in a GPU run)")
    config.addinivalue_line("markers", "slow: the thorough version of a test with a cheaper default twin "
                                       "(deselected by default; run with -m slow or -m \"\")")


def pytest_collection_modifyitems(config, items):
    needs, reason = (("gpu", "needs a GPU (MONODECODE_TEST_DEVICE=cuda)") if DEVICE == "cpu" else
                     ("cpu", "runs the kernels interpreted on the CPU: a GPU run imports them compiled"))
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if needs in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def compiled_env() -> dict:
    """The environment for a subprocess in which Triton compiles (its interpreter off)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
