"""Engine glue: drop-in pieces for serving engines, each importing its engine lazily.

``import kvxfer`` never imports this package, and no module here imports an engine at
import time: ``kvxfer.integrations.sglang_jax`` matches sglang-jax's interface without
importing it, and ``kvxfer.integrations.tpu_inference`` vLLM TPU's offload worker.
"""

__all__: list[str] = []
