"""Shared pytest setup: a fresh random seed for every run (docs/CONVENTIONS.md), printed so that a
failure can be replayed with FLASHATTN_TEST_SEED=<seed>."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest


def _base_seed() -> int:
    env = os.environ.get("FLASHATTN_TEST_SEED")
    if env:
        return int(env)
    return int.from_bytes(os.urandom(4), "little")


BASE_SEED = _base_seed()


def _seed_line() -> str:
    return f"flashattn tests: random seed {BASE_SEED} (replay with FLASHATTN_TEST_SEED={BASE_SEED})"


def pytest_report_header(config):
    return _seed_line()


def pytest_terminal_summary(terminalreporter):
    # Also at the end: the header is hidden under -q, and the seed matters most after a failure.
    terminalreporter.write_line(_seed_line())


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A numpy Generator seeded from the run's seed and the test's id: each test draws the same
    numbers when replayed, whichever subset of tests runs."""
    return np.random.default_rng([BASE_SEED, zlib.crc32(request.node.nodeid.encode())])
