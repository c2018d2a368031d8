import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    assert jax.device_count() >= 8, "tests/mesh needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
