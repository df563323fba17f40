import os

import torch
from hypothesis import HealthCheck, settings

from circuitmath.strategies import DEVICE_VARIABLE


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="the device the property tests' models are drawn on (circuitmath.strategies): cpu or cuda")


def pytest_configure(config):
    os.environ[DEVICE_VARIABLE] = config.getoption("--device")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)  # two xdist workers on two cores

# A fast profile for local runs; "ci" (loaded by hypothesis itself when CI is set) derandomises,
# so a CI failure reproduces exactly, and runs more examples; "soak" (`make soak`) draws at random
# and runs many examples per test, to find the draws on which a property or a negative control
# fails that the fixed seeds never reach (a failure prints a blob that reproduces it).
settings.register_profile(
    "default",
    settings.get_profile("default"),
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci",
    settings.get_profile("ci"),
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "soak",
    settings.get_profile("default"),
    max_examples=int(os.environ.get("SOAK_EXAMPLES", "400")),
    derandomize=False,
    print_blob=True,
)
