"""MONODECODE_TEST_DEVICE=cuda runs the model tests on a GPU (the default is the CPU)."""

import os

import pytest


@pytest.fixture(scope="session")
def device() -> str:
    return os.environ.get("MONODECODE_TEST_DEVICE", "cpu")
