"""``python -m kiln.runtime.engine_process FD``: the engine process ``ProcessEngine`` starts, serving the socket FD."""

import sys

from kiln.runtime.engine_process.child import main

sys.exit(main(int(sys.argv[1])))
