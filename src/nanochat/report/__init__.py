"""What a run's records become: TensorBoard and W&B logs (`--log`), and the run.png picture."""
