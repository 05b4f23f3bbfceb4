"""kiln.models: model configs, weights, the JAX model graphs, checkpoint readers, attention kernels, sampling."""
