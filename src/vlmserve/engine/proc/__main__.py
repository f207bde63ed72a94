"""``python -m vlmserve.engine.proc FD``: an engine process on the connection ``FD``."""

import sys
from multiprocessing.connection import Connection

from vlmserve.engine.proc.core import run

if __name__ == "__main__":
    run(Connection(int(sys.argv[1])))
