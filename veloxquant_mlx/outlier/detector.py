"""`OutlierDetector` at its documented path (the seed pages); the code is :mod:`veloxquant_mlx.compat.outlier`,
with the rest of the seed API kept for compatibility (off the serving path)."""
from __future__ import annotations

from typing import Any  # noqa: F401  (this and the imports below: the names the module held before the move)

import mlx.core as mx  # noqa: F401
import numpy as np  # noqa: F401

from veloxquant_mlx.compat.outlier import OutlierDetector  # noqa: F401
from veloxquant_mlx.core.abstractions import as_float_rows  # noqa: F401
from veloxquant_mlx.core.constants import DEFAULT_N_CALIB_TOKENS  # noqa: F401
from veloxquant_mlx.validate import check_int  # noqa: F401
