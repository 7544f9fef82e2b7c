"""The engine in a child process of its own, behind the ``Engine`` interface: ``ProcessEngine`` is what ``LLM`` drives
when ``RuntimeOptions.engine_process`` is set; ``python -m kiln.runtime.engine_process`` is the child."""

from kiln.runtime.engine_process.proxy import ProcessEngine

__all__ = ["ProcessEngine"]
