import os
import sys

from ._cli import main

status = main()
# Leave without the interpreter's teardown: an interrupted `process` (SIGTERM while a worker
# thread writes a part) can abort at exit, after its output has been removed (SIGABRT,
# "terminate called without an active exception"), hiding its exit status; teardown is where
# C++ destructors run. Every file is closed by then; only the
# standard streams need flushing.
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
