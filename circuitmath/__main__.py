import os
import sys

from ._cli import main

status = main()
# Leave without the interpreter's teardown: once a part has been written by a worker thread,
# the C++ destructors run at a normal exit now and then abort the process (SIGABRT, "terminate
# called without an active exception") after the command has finished, hiding its exit status.
# Every file is closed by then; only the standard streams need flushing.
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
