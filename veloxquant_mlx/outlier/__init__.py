"""The seed pages' `OutlierDetector` at its documented path; the code is :mod:`veloxquant_mlx.compat.outlier`
(the seed API, kept for compatibility)."""
from veloxquant_mlx.outlier.detector import OutlierDetector

__all__ = ["OutlierDetector"]
