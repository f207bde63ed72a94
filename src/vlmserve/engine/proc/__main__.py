"""``python -m vlmserve.engine.proc FD``: an engine process on the connection ``FD``."""

import sys
from multiprocessing.connection import Connection

from vlmserve import heap

heap.pause()  # before the engine's imports: settled once the model is loaded (heap.py)

from vlmserve.engine.proc.core import run  # noqa: E402

if __name__ == "__main__":
    run(Connection(int(sys.argv[1])))
