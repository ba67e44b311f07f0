"""Test setup, in one place: the device and how Triton runs the kernels.

MONODECODE_TEST_DEVICE=cuda runs the tests on a GPU, the kernels compiled; the default is the CPU,
where the kernels run under Triton's interpreter (grid (1,)), which must be switched on before
any kernel module is imported, so here, before the tests are collected. Tests marked `gpu` need
a GPU and are skipped on the CPU.
"""

import os

import pytest

DEVICE = os.environ.get("MONODECODE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU (MONODECODE_TEST_DEVICE=cuda)")


def pytest_collection_modifyitems(config, items):
    if DEVICE != "cpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (MONODECODE_TEST_DEVICE=cuda)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def compiled_env() -> dict:
    """The environment for a subprocess in which Triton compiles (its interpreter off)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
