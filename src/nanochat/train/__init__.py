"""The training loop (NanoChatTrainer) and its parts, each in the module its name says."""
