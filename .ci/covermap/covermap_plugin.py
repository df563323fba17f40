"""A pytest plugin for ``.ci/mutate.py``: records which test executes which line of the mutated modules.

Loaded with ``-p covermap_plugin`` (this folder first on ``PYTHONPATH``), it starts coverage when
pytest imports it, before any conftest or test module, so lines that run while modules are
imported are recorded too, in the empty context. Each test's lines are recorded in a context
named by its node id; the lines a fixture of a wider scope than one test runs (set up once for
the first test that needs it, then shared) in a context ``fixture:NAME``, which ``.ci/mutate.py``
reads as every test that uses the fixture. ``CM_COVERMAP_DATA`` names the data file and
``CM_COVERMAP_INCLUDE`` the files measured (comma-separated); ``CM_COVERMAP_DATA`` + ``.tests.json``
receives the node ids collected, in order, each with the fixtures it uses. The running context is
also put in the environment (``CM_COVERMAP_CONTEXT``), so a process a test or fixture starts
records its lines under the same context (:mod:`sitecustomize` in this folder).
"""

import json
import os

import coverage
import pytest

_COVERAGE = coverage.Coverage(data_file=os.environ["CM_COVERMAP_DATA"], config_file=False,
                              include=os.environ["CM_COVERMAP_INCLUDE"].split(","))
_COVERAGE.start()
_CONTEXT = [""]  # the context recorded now, last


def _switch(context: str) -> None:
    _COVERAGE.switch_context(context)
    os.environ["CM_COVERMAP_CONTEXT"] = context


def pytest_collection_modifyitems(items):
    tests = [[item.nodeid, sorted(getattr(item, "fixturenames", ()))] for item in items]
    with open(os.environ["CM_COVERMAP_DATA"] + ".tests.json", "w") as file:
        json.dump(tests, file)


def pytest_runtest_protocol(item, nextitem):
    _CONTEXT[-1] = item.nodeid
    _switch(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope == "function":
        yield
        return
    _CONTEXT.append(f"fixture:{fixturedef.argname}")
    _switch(_CONTEXT[-1])
    try:
        yield
    finally:
        _CONTEXT.pop()
        _switch(_CONTEXT[-1])


def pytest_unconfigure(config):
    _COVERAGE.stop()
    _COVERAGE.save()
