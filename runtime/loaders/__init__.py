"""graphdsl.runtime.loaders — reading checkpoints: safetensors files and directories, GGUF files
(tensors, metadata, tokenizer), HF tokenizers and the JSON files beside them. Loaders yield
``(checkpoint name, tensor)`` pairs; binding them to a model's Parameters is ``graphdsl.models.loader``."""
