"""The model: our GPT and its size presets, and Hugging Face models in and out (configs, weights, FP8 exports)."""
