"""The TensorRT-LLM 1.2.x builder: preflight, checkpoint conversion, trtllm-build, recorded against its contract."""
