"""Models: the Llama-family decoder (llama.py), Gemma 3 / 2 (gemma3.py), the architecture
registry (architectures.py), weight loading (loader.py), rope tables (rope.py),
GGUF conversion (gguf_convert.py), the embedded default model (default_model.py) and the
ForwardBatch the engine hands to a forward pass (forward_batch.py).

Import the submodules directly (e.g. `from radixserve.model.loader import load_model`); this
package module itself imports nothing so that light users (the CLI's `convert`) stay light.
"""
