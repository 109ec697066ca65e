"""Test-wide settings.

Hypothesis runs **derandomized** by default (profile ``ci``): the examples are a function of
the test, so a clean clone cannot turn red by chance, and a failure reproduces on every
machine. Explore new random examples with ``HYPOTHESIS_PROFILE=dev python3 -m pytest ...``;
a failure there prints a ``@reproduce_failure`` blob to paste into the test.

``-m "not slow"`` is the fast day-to-day subset (see README); .ci/run runs everything.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,  # a fixed seed per test: the same examples on every run
    database=None,  # nothing learnt from earlier runs on this machine changes what runs
    print_blob=True,
    deadline=None,  # 2 shared CPU cores: timing is not a property
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    derandomize=False,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
