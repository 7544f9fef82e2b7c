"""Engine builders (native, TensorRT-LLM) and the hash-keyed engine cache."""
