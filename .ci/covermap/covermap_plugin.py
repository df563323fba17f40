"""A pytest plugin for ``.ci/mutate.py``: records which test executes which line of the mutated modules.

Loaded with ``-p covermap_plugin`` (this folder first on ``PYTHONPATH``), it starts coverage when
pytest imports it, before any conftest or test module, so lines that run while modules are
imported are recorded too, in the empty context; each test's lines are recorded in a context
named by its node id. ``CM_COVERMAP_DATA`` names the data file and ``CM_COVERMAP_INCLUDE`` the
files measured (comma-separated). The node id of the running test is also put in the environment
(``CM_COVERMAP_CONTEXT``), so a process the test starts records its lines under the same test
(:mod:`sitecustomize` in this folder).
"""

import os

import coverage

_COVERAGE = coverage.Coverage(data_file=os.environ["CM_COVERMAP_DATA"], config_file=False,
                              include=os.environ["CM_COVERMAP_INCLUDE"].split(","))
_COVERAGE.start()


def pytest_runtest_protocol(item, nextitem):
    _COVERAGE.switch_context(item.nodeid)
    os.environ["CM_COVERMAP_CONTEXT"] = item.nodeid


def pytest_unconfigure(config):
    _COVERAGE.stop()
    _COVERAGE.save()
