"""Started by every Python process of a ``.ci/mutate.py`` coverage run (this folder is on
``PYTHONPATH`` there): a process a test (or a shared fixture) starts records the lines it runs
under the context that started it (``CM_COVERMAP_CONTEXT``), in a data file of its own beside the run's."""

import os

if os.environ.get("CM_COVERMAP_CONTEXT") and os.environ.get("CM_COVERMAP_DATA"):
    import atexit

    import coverage

    _COVERAGE = coverage.Coverage(data_file=f"{os.environ['CM_COVERMAP_DATA']}.process{os.getpid()}",
                                  config_file=False, include=os.environ["CM_COVERMAP_INCLUDE"].split(","))
    _COVERAGE.start()
    _COVERAGE.switch_context(os.environ["CM_COVERMAP_CONTEXT"])

    @atexit.register
    def _save():
        _COVERAGE.stop()
        _COVERAGE.save()
