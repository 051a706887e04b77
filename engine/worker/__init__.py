"""The engine's device side: the worker (device, weights, KV cache sizing), the model runner
and its input batch, the sampler, CUDA graphs, pinned buffers, memory profiling, CPU threads
and the step profiler. With attention/, models/ and ops/, the only layers that use torch."""
