"""kiln.models: what a model is, independent of where it runs or who asks.

config.py (ModelConfig), transformer.py (the model families as pure JAX functions over weight pytrees), batch.py and
step.py (the step program over Batch/KVCache pytrees), sampling.py (on-device sampling), checkpoint/ (HF safetensors
and GGUF readers, the tokenizer files), kernels/ (the reference paged attention and the per-accelerator kernels).
It imports jax, numpy and the checkpoint libraries only — never kiln.targets, kiln.compile or kiln.serving.
"""
