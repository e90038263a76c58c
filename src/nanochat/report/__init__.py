"""What a run's records become: TensorBoard and W&B (trackers.py), run.png (plot.py)."""
