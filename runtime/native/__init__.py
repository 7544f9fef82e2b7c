"""Kiln's native engine: the step loop, scheduler, paged KV block manager, model runner, CUDA graphs, the Llama model,
its layers and Triton kernels; engine directories hold ``engine.json`` and the weights in runtime layout."""
