"""The training loop (trainer.py) and its parts, each in the module its name says."""
