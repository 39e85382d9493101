"""What is measured on a model once and reused by every cache built for it: a `Calibration`.

- :mod:`~veloxquant_mlx.calibration.weights`: the math (channel weights from second moments; pure functions);
- :mod:`~veloxquant_mlx.calibration.file`: the `Calibration` object, its file (safetensors + versioned JSON
  metadata) and the model fingerprint it is bound to;
- `calibrate` (runs the model on calibration text, with attention routed) is one layer up, in
  :mod:`veloxquant_mlx.measure_calibration`: this package sits below the options and the builder that read a
  `Calibration`, so it imports neither the integration nor anything that runs a model.

Nothing is imported here (``veloxquant_mlx.calibrate`` / ``veloxquant_mlx.Calibration`` are the public names).
"""
