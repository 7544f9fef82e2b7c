"""``python -m kiln.runtime.engine_process FD PARENT_PID LOG_LEVEL LOG_CONFIG``: the engine process
``ProcessEngine`` starts, serving the socket FD and logging as the parent does: as its configuration file
LOG_CONFIG says, or ("" for none) from its level, LOG_LEVEL (0: none set, no handler added)."""

import sys

from kiln.runtime.engine_process.lifetime import die_with_parent

die_with_parent(int(sys.argv[2]))  # before the imports below, which take seconds (torch)

from kiln.runtime.engine_process.child import main  # noqa: E402

sys.exit(main(int(sys.argv[1]), int(sys.argv[3]), sys.argv[4]))
