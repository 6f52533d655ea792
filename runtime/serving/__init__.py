"""graphdsl.runtime.serving — running requests on an engine: the paged KV cache and its block
manager, the continuous-batching scheduler, sampling parameters and the on-device sampler, CUDA
graphs for decode steps, and the (overlapped) serving loop that ties them together."""
