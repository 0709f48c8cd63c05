"""Test setup: 8 simulated CPU devices, configured before JAX initialises."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def handover_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Donating, hand every kept shard over, however small: by default arrays keeping
    under ``_execute.HANDOVER_BYTES`` in place copy them (cheaper than re-homing)."""
    from reshard import _execute

    monkeypatch.setattr(_execute, "HANDOVER_BYTES", 0)
