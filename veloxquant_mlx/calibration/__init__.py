"""What is measured on a model once and reused by every cache built for it: a `Calibration`.

- :mod:`~veloxquant_mlx.calibration.weights`: the math (channel weights from second moments; pure functions);
- :mod:`~veloxquant_mlx.calibration.file`: the `Calibration` object, its file (safetensors + versioned JSON
  metadata) and the model fingerprint it is bound to;
- :mod:`~veloxquant_mlx.calibration.measure`: `calibrate` (runs the model on calibration text).

Nothing is imported here (``veloxquant_mlx.calibrate`` / ``veloxquant_mlx.Calibration`` are the public names), so
the cache builder can read a `Calibration` without importing what runs the model.
"""
