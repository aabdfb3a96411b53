"""MLX through mlx-lm: everything localrun knows and does about this engine."""
