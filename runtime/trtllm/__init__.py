"""A TensorRT-LLM 1.2.x engine behind Kiln's engine interface; ``tensorrt_llm`` is imported only when one loads."""
