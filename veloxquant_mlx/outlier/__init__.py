"""Outlier-channel detection for the two-stream (outliers apart, inliers quantized) caches."""
from veloxquant_mlx.outlier.detector import OutlierDetector

__all__ = ["OutlierDetector"]
