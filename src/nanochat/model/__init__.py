"""The model: our GPT (gpt.py) and Hugging Face models in and out (hf.py, hf_fp8.py)."""
