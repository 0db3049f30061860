"""Optimizers (adamw, master_adamw), the learning-rate schedule (schedule), and the
optimizer's side of one training step (step)."""
