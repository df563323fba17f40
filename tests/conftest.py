import os

import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)  # two xdist workers on two cores

# A fast profile for local runs; "ci" (loaded by hypothesis itself when CI is set) derandomises,
# so a CI failure reproduces exactly, and runs more examples.
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
